"""LoRA adapters for drafts: attach, save with a fingerprint of the base model, load (merged or not).

peft checks shapes but not identity: an adapter trained on another model of the same shape loads silently and is
wrong. So an adapter folder also holds ``rift_base.json``, a fingerprint of the base weights it was trained on: the
config's identity and the sha256 of the input embedding's bytes. A hash is exact and independent of thread count and
summation order (a float checksum is not: it refused adapters on the very model they were trained on). The weights
load from ``adapter_model.safetensors`` only: a pickled ``adapter_model.bin`` is refused (unpickling can run code).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import warnings
from pathlib import Path

import torch

from .models import DTYPES, first_line, safetensors_problem

FINGERPRINT_FILE = "rift_base.json"
# Every linear layer of the supported families (names match as module-name suffixes, as peft matches them):
# attention and MLP, and the projections of linear-attention blocks: Qwen3.5's Gated DeltaNet (in_proj_qkv / _z /
# _a / _b, linear_attn.out_proj) and Nemotron-H's Mamba-2 (in_proj only: its out_proj and conv1d weights are read
# directly by the fused Mamba kernel, so peft refuses LoRA on them).
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                          "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "linear_attn.out_proj", "in_proj")


def _identity(model) -> dict:
    cfg = model.config
    return {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
            "hidden_size": getattr(cfg, "hidden_size", None),
            "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
            "embedding_shape": list(model.get_input_embeddings().weight.shape)}


def _dtype_name(model) -> str:
    return str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")


def embedding_sha256(model, dtype: str | None = None) -> str:
    """sha256 of the input embedding's bytes, cast to ``dtype`` (a name in ``models.DTYPES``; default: as it is)."""
    w = model.get_input_embeddings().weight.detach()
    w = w.to("cpu", DTYPES[dtype] if dtype else w.dtype).contiguous()
    return hashlib.sha256(w.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def fingerprint(model) -> dict:
    """What ``rift_base.json`` records. The hash is kept for every precision the base may be loaded in later: a
    checkpoint loaded in bfloat16 holds exactly the bfloat16 cast of its float32 load, so one adapter serves both."""
    return {**_identity(model), "dtype": _dtype_name(model),
            "embedding_sha256": {name: embedding_sha256(model, name) for name in DTYPES}}


def _legacy_checksum(model) -> float:
    """The float checksum rift_base.json held before the sha256 (compared loosely: it depends on summation order)."""
    emb = model.get_input_embeddings().weight.detach().float()
    return float(emb.sum() + (emb * emb).sum())


def check_base(want: dict, base, folder) -> None:
    """ValueError (one line) unless ``base`` is the model the fingerprint ``want`` was taken from."""
    diff = [f"{k} {want[k]} (adapter) vs {v} (given)" for k, v in _identity(base).items() if k in want and want[k] != v]
    if not diff:
        dtype, hashes, legacy = _dtype_name(base), want.get("embedding_sha256"), want.get("embedding_checksum")
        if isinstance(hashes, dict):
            if hashes.get(dtype) != embedding_sha256(base):
                hint = "" if want.get("dtype") in (None, dtype) else \
                    f" (the adapter's base was a {want['dtype']} load, this one is {dtype}: load it as that was)"
                diff = [f"the embedding weights differ{hint}"]
        elif isinstance(legacy, (int, float)):
            if not math.isclose(legacy, _legacy_checksum(base), rel_tol=1e-4, abs_tol=0.01):
                diff = ["the embedding checksum differs"]
        else:
            diff = [f"{FINGERPRINT_FILE} holds no embedding fingerprint"]
    if diff:
        raise ValueError(f"the adapter in {folder} was trained for another base model: {'; '.join(diff)}")


def attach(model, rank: int = 8, alpha: int = 16, dropout: float = 0.0, target_modules=DEFAULT_TARGET_MODULES,
           layers: list[int] | None = None):
    """A trainable LoRA wrapper around ``model`` (which is left frozen); ``layers``: adapt only these decoder layers
    (negative indices count from the last; default: all)."""
    from peft import LoraConfig, get_peft_model

    names = [name for name, _ in model.named_modules()]
    modules = [m for m in target_modules if any(n == m or n.endswith("." + m) for n in names)]
    if not modules:
        raise ValueError(f"none of the LoRA target modules {list(target_modules)} exist in this model")
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if layers is not None:
        if not layers or any(not -n_layers <= i < n_layers for i in layers):
            raise ValueError(f"LoRA layers {list(layers)} are not all among this model's {n_layers} layers "
                             f"(0..{n_layers - 1}, or -1 for the last)")
        layers = sorted({i % n_layers for i in layers})
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, bias="none",
                     task_type="CAUSAL_LM", layers_to_transform=None if layers is None else list(layers))
    return get_peft_model(model, cfg)


def save(peft_model, base_fingerprint: dict, folder: str | Path) -> None:
    folder = Path(folder)
    peft_model.save_pretrained(folder)
    (folder / FINGERPRINT_FILE).write_text(json.dumps(base_fingerprint, indent=1))


def check_adapter(folder: str | Path) -> dict | None:
    """Check an adapter folder's files without loading a model; returns its base fingerprint (None if it has none).
    FileNotFoundError / ValueError with a one-line message for a missing, truncated or corrupt file, and ValueError
    for weights in a pickle (``adapter_model.bin``) alone: peft loads ``adapter_model.safetensors`` whenever it is
    there, so with this check no adapter loads through a pickle."""
    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} holds no LoRA adapter (adapter_config.json)")
    _read_object(folder / "adapter_config.json")
    weights = folder / "adapter_model.safetensors"
    if weights.is_file():
        if problem := safetensors_problem(weights):
            raise ValueError(f"{problem}; retrain the adapter or copy it again")
    elif (folder / "adapter_model.bin").is_file():  # peft would unpickle it: code in it could run
        raise ValueError(f"{folder / 'adapter_model.bin'}: refused: a pickled adapter; adapters load from "
                         "adapter_model.safetensors only (peft's save_pretrained writes one)")
    else:
        raise FileNotFoundError(f"{str(folder)!r} holds no adapter weights (adapter_model.safetensors)")
    fp_file = folder / FINGERPRINT_FILE
    return _read_object(fp_file) if fp_file.is_file() else None


def _read_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def load_drafter(base, folder: str | Path, merge: bool = False, copy_base: bool = True):
    """``base`` with the adapter in ``folder`` applied. ``copy_base`` keeps ``base`` itself unadapted (needed for
    self-speculation, where the unadapted model verifies). ``merge`` folds the adapter into the weights.
    An adapter whose fingerprint names another base, or whose files are broken, is refused (ValueError)."""
    from peft import PeftModel
    from safetensors import SafetensorError

    want = check_adapter(folder)
    if want is not None:
        check_base(want, base, folder)
    model = copy.deepcopy(base) if copy_base else base
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft calls a deprecated transformers name (5.24)
            drafter = PeftModel.from_pretrained(model, str(folder))
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, SafetensorError) as e:
        # torch lists shape mismatches below a generic first line: name the first one
        reason = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), first_line(e))
        raise ValueError(f"could not load the LoRA adapter in {folder}: {reason}") from None
    drafter.eval()
    if merge:
        drafter = drafter.merge_and_unload()
    for p in drafter.parameters():
        p.requires_grad_(False)
    return drafter


def load_self_drafter(target, folder: str | Path):
    """The target drafting for itself with the adapter in ``folder``, on one set of weights: the LoRA layers go into
    the target's own modules (no second copy of the model: the adapter is kilobytes beside it) and are switched *off*
    at rest, so every forward of ``target`` (a verify, ``generate``, a greedy reference) runs the base weights. The
    decoder switches them on for its draft passes only (:class:`AdapterSwitch`). Refused in one line like
    :func:`load_drafter`: an adapter of another base, broken files."""
    if AdapterSwitch(target).layers:
        raise ValueError("this model already holds LoRA layers (a self-drafter loaded into it before): use that "
                         "drafter, or load the model again for another adapter")
    drafter = load_drafter(target, folder, copy_base=False)
    AdapterSwitch(drafter).set(False)
    return drafter


def shares_weights(draft, target) -> bool:
    """Whether ``draft`` is a peft model built on ``target`` itself (a self-drafter with an adapter)."""
    base = getattr(draft, "get_base_model", None)
    return draft is not target and base is not None and base() is target


class AdapterSwitch:
    """The adapter layers of a peft model, switched on and off in place. peft's ``disable_adapter()`` context does
    the same but scans the whole model for its status on every entry; a decoder switches twice a round, so the
    layers are collected once here. Off, a layer computes its base layer alone (the target's exact weights)."""

    def __init__(self, peft_model):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]

    def set(self, on: bool) -> None:
        for layer in self.layers:
            layer.enable_adapters(on)

    @contextlib.contextmanager
    def on(self):
        """The adapter on for the body (the draft passes), off after it, whatever happens inside."""
        self.set(True)
        try:
            yield
        finally:
            self.set(False)


@torch.no_grad()
def max_lora_delta(peft_model) -> float:
    """Largest |B @ A| entry over the adapted layers (0 for a freshly initialised adapter)."""
    best = 0.0
    for module in peft_model.modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
            best = max(best, float(delta.abs().max()))
    return best
