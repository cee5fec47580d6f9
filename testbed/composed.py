"""The shipped testbed pair: two trained language models, with the disclosed copier composed beside them at load.

What is stored (``assets/``): the trained target and draft (``lm-target/``, ``lm-draft/``: plain HF Llamas trained
from random initialisation, nothing hand-set; ``experiments/build_testbed.py``) and ``circuit.json``, the copier's
settings (one :class:`~rift_ada.testbed.circuit.CopyCircuit` per role), the calibration text it reads the trained
residual's scale and the tokens' rarity from (token ids, so the composition does not depend on the interpreter's
standard library), and the SHA-256 of the composed weights. What is derived: the composed pair
(:func:`~rift_ada.testbed.circuit.compose`), written once into a cache folder and loaded from there with
``from_pretrained`` like any other checkpoint. The composed weights are never committed: they are ~90% zeros and
several times the size of what they are built from.

Names (names.py, registered with ``rift_ada.models``): ``testbed`` / ``testbed-target`` and ``testbed-draft`` give the
composed pair; ``testbed-lm`` / ``testbed-lm-target`` and ``testbed-lm-draft`` the trained pair alone, so a reader can
see which results depend on the hand-set copier.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

import torch

from rift_ada.files import cache_root, locked

from .circuit import CopyCircuit, compose, sort_labels

ASSETS = Path(__file__).resolve().parent / "assets"
LM_FOLDERS = {"target": "lm-target", "draft": "lm-draft"}
SETTINGS = "circuit.json"
# The copier composed beside each trained model by experiments/build_testbed.py (the settings a build stores). The
# target follows the sort family's order line (label_dim) and tells apart sources whose last ~40 tokens repeat with
# four near windows and a far one (40-120 tokens back, 9-dim codes: heads widened by 20 dims), the far window
# switched off for ~120 tokens after a sort header (far_gate) and weighted 0.35; greedy copy on four unseen code
# bases went from 0.71-0.83 to 0.92-0.96 (teacher-forced proxy, docs/testbed.md). The draft's head_dim of 48 leaves 48
# non-turning dims: three near windows and a far one of 6-dim codes.
# Both serve 40,960 positions (a 32K-token prompt and 4K generated tokens, with room): the trained models were
# trained up to 4.6K tokens, and their context of 8,192 is theirs alone (testbed-lm). Their copiers run ahead of the
# trained layers on a ballasted embedding (lead), so that their positional heads, far gate, key norms, match head and
# agreement read the scale they were written at, at every position (with one layer ahead, whose agreement still read
# after trained layer 0, pip 8K copies fell to 0.80 / 0.78). The target's gate runs ahead too (lead 3, 7 layers):
# with lead 2 it read after trained layer 0's attention, and at setuptools 16K prompt 0 it passed a bonus ~10x too
# large for a wrong token (target copy 0.656); the draft copies every long check whole with lead 2 (4 layers), and
# its steps are what speculation pays for. They store their columns at 0.02 of an embedding row's norm, so the
# trained layers, which see all of them, barely do (code NLL at 2K: 1.68 at 0.02 against 1.72 at 0.05, target;
# docs/testbed.md). With lead the draft's two near windows derailed two 2K copies of twelve on near ties; three tell
# them apart.
CONTEXT = 40960
CIRCUITS = {"target": CopyCircuit(label_dim=16, windows=((4, 8), (8, 16), (16, 28), (28, 40)),
                                  far_windows=((40, 120),), far_weight=0.35, far_gate=True, match_dim=9,
                                  extra_head_dims=20, context=CONTEXT, lead=3, scale=0.02),
            "draft": CopyCircuit(windows=((4, 8), (8, 16), (16, 40)), far_windows=((40, 120),), match_dim=6,
                                 context=CONTEXT, lead=2, scale=0.02)}
# Code whose change changes the composed weights: part of the cache key.
_SOURCES = (Path(__file__).resolve().parent / "circuit.py", Path(__file__).resolve())


def lm_folder(role: str, assets: Path = ASSETS) -> Path:
    return Path(assets) / LM_FOLDERS[role]


def trained_folder(role: str, assets: Path = ASSETS) -> Path:
    """The trained ``role`` model's folder; FileNotFoundError (one line) if the build never wrote it."""
    folder = lm_folder(role, assets)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the trained testbed {role} is missing at {folder}; rebuild it with "
                                "`python experiments/build_testbed.py`")
    return folder


def read_settings(assets: Path = ASSETS) -> dict:
    path = Path(assets) / SETTINGS
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: rebuild the testbed with `python experiments/build_testbed.py`")
    return json.loads(path.read_text())


def circuit_of(settings: dict, role: str, changes: dict | None = None) -> CopyCircuit:
    """The role's CopyCircuit from its JSON form (lists back to the dataclass's tuples), with ``changes`` (the same
    JSON form) over the stored settings."""
    raw = {**settings["circuits"][role], **(changes or {})}
    names = {f.name for f in fields(CopyCircuit)}
    if set(raw) - names:
        raise ValueError(f"{SETTINGS}: unknown circuit settings {sorted(set(raw) - names)} for the {role}")
    kw = {k: tuple(tuple(w) for w in v) if k in ("windows", "far_windows") else tuple(v) if isinstance(v, list)
          else v for k, v in raw.items()}
    return CopyCircuit(**kw)


def write_settings(assets: Path, circuits: dict[str, CopyCircuit], calibration: list[list[int]],
                   seed: int = 0) -> None:
    """``circuit.json`` for the trained models in ``assets`` (the composed checksums are added by
    :func:`pin_checksums` once the pair is composed)."""
    settings = {"about": "settings of the hand-set copier composed beside the trained models at load "
                         "(rift_ada.testbed.composed); calibration: token ids of plain training-split code",
                "seed": seed, "circuits": {role: asdict(c) for role, c in circuits.items()},
                "calibration": calibration, "composed_sha256": {}}
    (Path(assets) / SETTINGS).write_text(json.dumps(settings, indent=1) + "\n")


def weights_sha256(model) -> str:
    """SHA-256 over a model's state dict (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@torch.no_grad()
def compose_role(role: str, assets: Path = ASSETS, changes: dict | None = None):
    """The composed ``role`` model (float32, CPU, eval mode), built from the stored trained model and settings;
    ``changes`` to the copier's settings give an unpinned variant (experiments/copy_probe.py)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    settings = read_settings(assets)
    folder = lm_folder(role, assets)
    lm = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    circuit = circuit_of(settings, role, changes)
    labels = sort_labels(AutoTokenizer.from_pretrained(folder)) if circuit.label_dim else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions split over threads round differently: one thread, the same bits always
    try:
        return compose(lm, circuit, settings["calibration"], seed=settings["seed"], labels=labels)
    finally:
        torch.set_num_threads(threads)


def weights_moments(model) -> dict[str, list[float]]:
    """Per tensor of the state dict, [sum, sum of |x|, sum of x^2] in float64: what a composition on another CPU
    must match to rounding (its bytes may differ: the calibration forward and the kernel fits round differently
    under other SIMD kernels), while any change to the circuit or the trained weights moves them far more."""
    out = {}
    for name, t in sorted(model.state_dict().items()):
        x = t.detach().cpu().double()
        out[name] = [float(x.sum()), float(x.abs().sum()), float((x * x).sum())]
    return out


def pin_checksums(assets: Path = ASSETS) -> dict:
    """Compose both roles (into the cache) and record their checksums and moments in ``circuit.json``; returns the
    checksums."""
    from transformers import LlamaForCausalLM

    sums, moments = {}, {}
    for role in LM_FOLDERS:
        with _quiet():
            model = LlamaForCausalLM.from_pretrained(composed_folder(role, assets))
        sums[role], moments[role] = weights_sha256(model), weights_moments(model)
    settings = read_settings(assets)
    settings["composed_sha256"], settings["composed_moments"] = sums, moments
    (Path(assets) / SETTINGS).write_text(json.dumps(settings, indent=1) + "\n")
    return sums


def _fingerprint(role: str, assets: Path) -> str:
    """What the composed weights depend on: torch, the trained model, the settings (less the checksums they
    record) and the code that composes. Hashed once per state of those files (one load resolves a name several
    times)."""
    folder = lm_folder(role, assets)
    paths = (folder / "config.json", folder / "model.safetensors", Path(assets) / SETTINGS, *_SOURCES)
    return _hash_inputs(paths, tuple((p.stat().st_mtime_ns, p.stat().st_size) for p in paths))


@functools.lru_cache(maxsize=16)
def _hash_inputs(paths: tuple, stamps: tuple) -> str:
    h = hashlib.sha256(torch.__version__.encode())
    settings_path = paths[2]
    settings = {k: v for k, v in json.loads(settings_path.read_text()).items()
                if k not in ("composed_sha256", "composed_moments")}
    h.update(json.dumps(settings, sort_keys=True).encode())
    for path in paths[:2] + paths[3:]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def composed_folder(role: str, assets: Path = ASSETS) -> Path:
    """A HuggingFace folder holding the composed ``role`` model and the tokenizer: composed on first use (about
    ten seconds on 2 cores), then reused while the stored models, settings and circuit code are unchanged."""
    if role not in LM_FOLDERS:
        raise ValueError(f"role must be one of {', '.join(LM_FOLDERS)}")
    trained_folder(role, assets)
    name = f"testbed-{role}-{_fingerprint(role, assets)}"
    out = cache_root() / name
    if (out / "config.json").is_file():
        return out
    with locked(cache_root() / f".{name}.lock"):
        if (out / "config.json").is_file():  # another process composed it while this one waited
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_root()))
        tmp.chmod(0o755)
        try:
            with _quiet():
                compose_role(role, assets).save_pretrained(tmp)
            _copy_tokenizer(lm_folder(role, assets), tmp)
            os.replace(tmp, out)  # atomic: a reader sees the whole folder or none
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """The trained model's tokenizer files, with ``model_max_length`` set to the composed model's context (the
    tokenizer warns about any longer input)."""
    context = json.loads((dst / "config.json").read_text())["max_position_embeddings"]
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)
    config = dst / "tokenizer_config.json"
    if config.is_file():
        settings = json.loads(config.read_text())
        settings["model_max_length"] = context
        config.write_text(json.dumps(settings, indent=2) + "\n")


@contextlib.contextmanager
def _quiet():
    """No transformers progress bars while composing: a command's stderr stays its own (one-line errors)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


__all__ = ["ASSETS", "CIRCUITS", "CONTEXT", "LM_FOLDERS", "cache_root", "circuit_of", "compose_role", "composed_folder",
           "lm_folder", "pin_checksums", "read_settings", "trained_folder", "weights_moments", "weights_sha256",
           "write_settings"]
