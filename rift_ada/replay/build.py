"""Building replay tables: one prompt's (:func:`build_table`), and a prompt set's (:func:`build_tables`: a file per
prompt, resumable, in worker processes or shared out under torchrun)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..architectures import UnsupportedModelError
from ..cache import RiftCache
from ..files import atomic_write
from ..layout import CacheLayout
from ..lora import AdapterSwitch, shares_weights
from ..rounds import entropy, sampling_probs, token_probs
from ..signals import RUNWAY_CAP
from ..speculative import Decoding
from .rows import Dense, RowPass, dense_pass, selections
from .table import FORMAT, ReplayTable, derived_path, fingerprint, layout_dict


def check_layout(layout: CacheLayout, prompt_len: int) -> None:
    """ValueError (one line) for a layout a table cannot stand for."""
    if not layout.refreshable:
        raise ValueError(f"a replay table needs a draft cache that refreshes (a rift layout with a backing store), "
                         f"not {layout.describe()}")
    if prompt_len < layout.budget:
        raise ValueError(f"a replay table needs a prompt longer than the budget ({prompt_len} <= {layout.budget} "
                         "tokens): the cache would hold it whole")


def continuation(target, draft, prompt_ids: Sequence[int], max_new_tokens: int, decoding: Decoding,
                 eos_token_id: int | None) -> list[int]:
    """The target's output for the prompt (greedy, or sampled with ``decoding.seed``): speculative decoding with the
    full draft cache while it pays, plain target steps where the draft guesses little (:class:`SpeculateWhilePaying`:
    every round keeps the exact rejection rule, so the output is the target's either way; static steps where the
    models allow)."""
    from ..evaluate import decode
    from ..speculative import SpeculativeDecoder
    from ..static import check_static

    steps = {}
    for role, model, key in (("draft", draft, "draft_step"), ("target", target, "verify_step")):
        try:
            check_static(model, role)
            steps[key] = "static"
        except UnsupportedModelError:
            steps[key] = "model"
    dec = SpeculativeDecoder(target, None if draft is target else draft, CacheLayout("full"), decoding.draft_length,
                             temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k,
                             eos_token_id=eos_token_id, seed=decoding.seed, **steps)
    return decode(dec, list(prompt_ids), max_new_tokens, SpeculateWhilePaying(decoding.draft_length)).tokens


class SpeculateWhilePaying:
    """A joint controller for a table's continuation: full draft rounds while their tokens per round (an EMA) stay at
    ``min_emitted`` or above; below it, plain target steps, then one speculative round to look again, the plain
    stretch doubling (from ``plain`` up to ``max_plain``) each time the look finds the draft still guessing little.

    Why: on high-entropy text a full-cache draft round at k = 11 emits about 2 tokens for the price of ~5 plain
    target steps on this CPU (measured at 1K tokens: 185 ms a round, 38 ms a plain step), so a table's continuation
    took 120 s instead of ~40 s. The rule reads only the emitted counts, never a clock, so a seed gives the same
    continuation on any machine."""

    joint = True  # decides each round's draft length too (rift_ada.joint's contract)

    def __init__(self, draft_length: int, min_emitted: float = 3.0, plain: int = 16, max_plain: int = 256,
                 decay: float = 0.5):
        self.k = self.k_max = draft_length
        self.min_emitted, self.first_plain, self.max_plain, self.decay = min_emitted, plain, max_plain, decay
        self.ema, self.plain, self.left, self.last = float(draft_length + 1), plain, 0, None

    def act(self, state) -> tuple[bool, int]:
        if self.last is not None:  # the round just finished drafted: its tokens update the estimate
            self.ema = self.decay * self.ema + (1 - self.decay) * (state.generated - self.last)
            if self.ema < self.min_emitted:
                self.left, self.plain = self.plain, min(2 * self.plain, self.max_plain)
            else:
                self.plain = self.first_plain
        if self.left > 0:
            self.left, self.last = self.left - 1, None
            return False, 0
        self.last = state.generated
        return False, self.k

@torch.inference_mode()
def build_table(target, draft, prompt_ids: Sequence[int], layout: CacheLayout, decoding: Decoding,
                max_new_tokens: int, eos_token_id: int | None = None, names: tuple[str, str] = ("", ""),
                rows_per_batch: int = 16, progress: bool = False, tokens: Sequence[int] | None = None,
                p: Sequence[float] | None = None) -> ReplayTable:
    """The replay table of one prompt (``rift_ada.replay.table``): ``draft`` (``target`` for self-speculation) under
    ``layout`` (its ``refresh_grid`` is the table's grid), the target emitting with ``decoding``'s temperature,
    top-k, top-p and seed. ``names``: how the target and draft were named (kept beside their fingerprints).
    ``tokens``: a continuation the target emitted already (e.g. a real decode's output), instead of decoding one;
    ``p``: the target's probability of each of them (:func:`target_probs`), instead of a target pass."""
    prompt_ids = list(prompt_ids)
    P = len(prompt_ids)
    check_layout(layout, P)
    seconds = {}
    t0 = time.perf_counter()
    if tokens is None:
        tokens = continuation(target, draft, prompt_ids, max_new_tokens, decoding, eos_token_id)
    tokens = list(tokens)
    seconds["continuation"] = time.perf_counter() - t0
    N = len(tokens)
    if N < 2:
        raise ValueError(f"the continuation has {N} token(s): a table needs at least 2 (raise max_new_tokens)")
    device = target.device
    ids = torch.tensor([prompt_ids + tokens], device=device)
    t0 = time.perf_counter()
    p = target_probs(target, ids, P, decoding) if p is None else torch.as_tensor(p, device=device).float()
    seconds["target_p"] = time.perf_counter() - t0
    return _draft_table(draft, ids, P, p, layout, decoding, max_new_tokens, eos_token_id,
                        {"target": model_fingerprint(target), "target_name": names[0], "draft_name": names[1]},
                        seconds, rows_per_batch, progress)


@torch.inference_mode()
def target_probs(target, ids: torch.Tensor, prompt_len: int, decoding: Decoding) -> torch.Tensor:
    """The target's probability of each continuation token in ``ids`` (1, prompt + N) under ``decoding``'s
    sampling (one teacher-forced pass; all ones when greedy)."""
    N = ids.shape[1] - prompt_len
    if decoding.temperature == 0:
        return torch.ones(N, device=ids.device)
    logits = target(ids, position_ids=torch.arange(ids.shape[1], device=ids.device)[None], use_cache=False,
                    logits_to_keep=N + 1).logits[0, :N].float()  # position P - 1 + u predicts token u
    return token_probs(logits, ids[0, prompt_len:], decoding.temperature, decoding.top_k, decoding.top_p)


@torch.inference_mode()
def derive_table(draft, base: ReplayTable, layout: CacheLayout, draft_name: str = "", dense: Dense | None = None,
                 rows_per_batch: int = 16, progress: bool = False) -> ReplayTable:
    """The table of ``base``'s prompt and continuation (its target and p too) for another draft cache ``layout``
    (another budget) or another ``draft`` (the target itself, for self-speculation): no decode, no target pass.
    ``dense``: the draft's :func:`dense_pass` over the same tokens, if computed already."""
    P = base.prompt_len
    check_layout(layout, P)
    h = base.header
    decoding = Decoding(temperature=h["temperature"], top_k=h["top_k"], top_p=h["top_p"], seed=h["seed"])
    ids = torch.tensor([base.prompt.tolist() + base.tokens.tolist()], device=draft.device)
    p = torch.as_tensor(base.p, device=draft.device)
    return _draft_table(draft, ids, P, p, layout, decoding, h["max_new_tokens"], h["eos_token_id"],
                        {"target": h["target"], "target_name": h["target_name"], "draft_name": draft_name},
                        {}, rows_per_batch, progress, dense)


def _draft_table(draft, ids, P, p, layout, decoding, max_new_tokens, eos_token_id, names, seconds, rows_per_batch,
                 progress, dense=None) -> ReplayTable:
    """The draft's part of a table (dense pass, selections, rows) over ``ids`` = prompt + continuation."""
    from tqdm.auto import tqdm

    grid, N = layout.refresh_grid, ids.shape[1] - P
    x = ids[0, P:]
    t0 = time.perf_counter()
    if dense is None:
        with drafting(draft):
            dense = dense_pass(draft, ids)
    full_logits = dense.logits[P - 1:P - 1 + N]
    full_probs = sampling_probs(full_logits, decoding.temperature, decoding.top_k, decoding.top_p)
    full_q = ((full_logits.argmax(-1) == x).float() if full_probs is None
              else full_probs.gather(-1, x[:, None])[:, 0])
    starts = list(range(P, P + N - 1, grid))  # a refresh at history length t needs a query at t .. P + N - 2
    sel = selections(dense, starts, layout)
    seconds["dense"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    R = len(starts)
    out = {name: np.full((R, N), np.nan, dtype=np.float32) for name in ("q", "entropy", "focus", "runway", "drift")}
    with folded(draft):  # RowPass reads the draft's weights (not its forwards): an adapter folded into them
        rows = RowPass(draft, ids, P, layout, dense, decoding.temperature, decoding.top_k, decoding.top_p)
        for g0 in tqdm(range(0, R, rows_per_batch), desc="table rows", leave=False, disable=not progress):
            part = slice(g0, min(g0 + rows_per_batch, R))
            vals = rows.run(starts[part], [s[part] for s in sel])
            for name, v in (("q", vals.q), ("entropy", vals.entropy), ("focus", vals.focus),
                            ("runway", vals.runway), ("drift", vals.drift)):
                out[name][part] = v
    seconds["rows"] = time.perf_counter() - t0
    prompt_ids = ids[0, :P].tolist()
    header = {
        "format": FORMAT, **names, "draft": draft_fingerprint(draft), "layout": layout_dict(layout),
        "temperature": float(decoding.temperature), "top_k": int(decoding.top_k), "top_p": float(decoding.top_p),
        "seed": int(decoding.seed), "grid": grid, "max_new_tokens": int(max_new_tokens), "eos_token_id": eos_token_id,
        "vocab_size": draft.config.vocab_size, "prompt_sha": prompt_sha(prompt_ids),
        "initial": initial_signals(draft, ids[:, :P], layout), "build_seconds": seconds,
    }
    header = json.loads(json.dumps(header))  # as a file holds it (tuples are lists), so a loaded one compares equal
    return ReplayTable(header, np.asarray(prompt_ids, dtype=np.int32), x.cpu().numpy().astype(np.int32),
                       p.float().cpu().numpy(), out["q"], out["entropy"], out["focus"], out["runway"], out["drift"],
                       full_q.float().cpu().numpy(), entropy(full_logits).float().cpu().numpy())


def derive_tables(pair, base: ReplayTable, layouts: dict, stem: Path) -> dict:
    """Tables of ``base``'s prompt and continuation under each of ``layouts`` (key -> layout; keys starting with
    ``self`` for the target drafting for itself: ``pair.target``, or ``pair.draft`` when that is a self-drafter with
    an adapter (:func:`with_adapter`); the others for ``pair.draft``), each in ``<stem>.<key>.safetensors``: kept if
    already there for the same prompt, continuation, draft and layout, else built (:func:`derive_table`;
    :func:`rift_ada.replay.fixed.fixed_table` for layouts that never refresh), one dense pass per model shared by its
    tables."""
    from tqdm.auto import tqdm

    from .fixed import fixed_table

    out, dense = {}, {}
    for key in tqdm(layouts, desc=f"derived tables of {stem.name}", leave=False):
        path, layout = derived_path(stem, key), layouts[key]
        name = "self" if key.startswith("self") else "draft"
        model = pair.draft if name == "draft" or shares_weights(pair.draft, pair.target) else pair.target
        expected = {"layout": layout_dict(layout), "draft": draft_fingerprint(model),
                    **{k: base.header[k] for k in ("target", "temperature", "seed", "prompt_sha")}}
        t = stored(path, expected)
        if t is not None and (t.tokens == base.tokens).all():
            out[key] = t
            continue
        if name not in dense:
            ids = torch.tensor([base.prompt.tolist() + base.tokens.tolist()], device=model.device)
            with drafting(model):
                dense = {name: dense_pass(model, ids)}  # one model's pass kept at a time
        if layout.kind != "rift":
            with folded(model):  # fixed_table's rows read the weights (dense is given: no forward in it)
                out[key] = fixed_table(model, base, layout, dense[name])
            out[key].header["draft"] = draft_fingerprint(model)  # base's header names base's draft
        else:
            out[key] = derive_table(model, base, layout, name, dense[name])
        out[key].save(path)
    return out


def initial_signals(draft, prompt: torch.Tensor, layout: CacheLayout) -> dict:
    """The read-ahead and drift signals right after the prefill, computed as the decoder computes them (the draft's
    own prefill and compression: ``SpeculativeDecoder.reset``; a self-drafter's adapter on)."""
    cache = RiftCache.for_config(draft.config, layout)
    pos = torch.arange(prompt.shape[1], device=prompt.device)[None]
    with drafting(draft):
        draft(prompt, cache=cache, position_ids=pos, rift_observer=cache, logits_to_keep=1)
    cache.compress()
    runway, focus = cache.read_ahead(RUNWAY_CAP)
    return {"runway": runway, "focus": focus, "drift": cache.query_drift()}


# --- a draft with a LoRA adapter --------------------------------------------------------------------------------------
def tuner_layers(model) -> list:
    """The LoRA (peft tuner) layers inside ``model``: a peft model's, or those a self-drafter put into its target."""
    return AdapterSwitch(model).layers


@contextlib.contextmanager
def drafting(draft):
    """The body's forwards of ``draft`` as it drafts: a self-drafter's adapter (off at rest,
    ``rift_ada.lora.load_self_drafter``) switched on, and off again after; any other model as it is."""
    layers = tuner_layers(draft) if hasattr(draft, "get_base_model") else []
    if any(layer.disable_adapters for layer in layers):
        with AdapterSwitch(draft).on():
            yield
    else:
        yield


@contextlib.contextmanager
def folded(draft):
    """For the body, each LoRA layer of a peft ``draft`` has its base weight plus its adapter's delta as its weight
    (a new tensor; the base weights themselves are untouched and put back after, whatever happens inside).
    ``RowPass`` reads a draft's linear weights rather than running its forwards, which would leave the adapter out.
    Run no forward of the model in the body: a switched-on adapter would count twice."""
    held = []
    try:
        for layer in tuner_layers(draft) if hasattr(draft, "get_base_model") else []:
            if layer.merged or not layer.active_adapters:
                continue
            base = layer.get_base_layer()
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
            held.append((base, base.weight))
            base.weight = torch.nn.Parameter(base.weight.detach() + delta, requires_grad=False)
        yield
    finally:
        for base, weight in reversed(held):
            base.weight = weight


def model_fingerprint(model) -> str:
    """``table.fingerprint`` of ``model`` as its forward computes at rest: a target holding a self-drafter's LoRA
    layers (switched off) is fingerprinted on its base weights alone, the same as before the adapter went in."""
    if not tuner_layers(model) or hasattr(model, "get_base_model"):
        return fingerprint(model)
    if model not in _BASE_FINGERPRINTS:
        _BASE_FINGERPRINTS[model] = fingerprint(_BaseWeights(model))
    return _BASE_FINGERPRINTS[model]


def draft_fingerprint(draft) -> str:
    """The draft's fingerprint in a table header: a peft model's is its base model's and its adapter's (the sha256 of
    the LoRA weights and scalings, ``<base>+<adapter>``), so a table of the adapted draft never passes for one of
    the plain model, nor of another adapter."""
    if not hasattr(draft, "get_base_model"):
        return model_fingerprint(draft)
    if draft not in _BASE_FINGERPRINTS:
        h = hashlib.sha256()
        for name, t in sorted(draft.state_dict().items()):
            if "lora_" in name:
                h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
                h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for name, module in draft.named_modules():
            if hasattr(module, "scaling") and hasattr(module, "active_adapters"):
                h.update(json.dumps([name, module.active_adapters, module.scaling], sort_keys=True).encode())
        _BASE_FINGERPRINTS[draft] = f"{model_fingerprint(draft.get_base_model())}+{h.hexdigest()[:16]}"
    return _BASE_FINGERPRINTS[draft]


class _BaseWeights:
    """A model's config and its state dict without LoRA layers (each ``<layer>.base_layer.<w>`` as ``<layer>.<w>``,
    its adapter's entries left out): what ``table.fingerprint`` hashes of the model the layers went into."""

    def __init__(self, model):
        self.config, self.model = model.config, model

    def state_dict(self) -> dict:
        layers = set(tuner_layers(self.model))
        names = [n for n, m in self.model.named_modules() if m in layers]
        out = {}
        for key, t in self.model.state_dict().items():
            owner = next((n for n in names if key.startswith(n + ".")), None)
            if owner is None:
                out[key] = t
            elif key.startswith(owner + ".base_layer."):
                out[owner + key[len(owner) + len(".base_layer"):]] = t
        return out


_BASE_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # hashing a model takes a while: once


def with_adapter(pair, folder: str | None):
    """``pair`` (``rift_ada.models.ModelPair``) with its draft adapted by the LoRA adapter in ``folder`` (None: the
    pair as it is). The target drafting for itself gets a self-drafter (``rift_ada.lora.load_self_drafter``: the
    adapter inside the target's own modules, on in the draft passes alone), an external draft a copy with the
    adapter merged into it (``rift_ada.lora.load_drafter``). Idempotent: the same adapted pair again for the same
    models and folder. Refused in one line: an adapter of another base, a model holding another adapter already."""
    from dataclasses import replace
    from pathlib import Path

    from ..lora import load_drafter, load_self_drafter

    if folder is None:
        return pair
    where = str(Path(folder).resolve())
    held = _ADAPTED.get(pair.draft)
    if held is None and (tuner_layers(pair.draft) or hasattr(pair.draft, "get_base_model")):
        held = ("another adapter", None)  # adapted elsewhere: which adapter it holds is not known here
    if held is not None and held[0] != where:
        raise ValueError(f"the draft holds {held[0]} already, not the adapter {folder}: load the models again")
    if held is None:
        draft = (load_self_drafter(pair.target, folder) if pair.draft is pair.target
                 else load_drafter(pair.draft, folder, merge=True))
        held = _ADAPTED[pair.draft] = _ADAPTED[draft] = (where, draft)
    return pair if held[1] is pair.draft else replace(pair, draft=held[1])


# model (as given, and as adapted) -> (adapter folder, adapted draft). An adapted draft holds its model, so an entry
# keeps both loaded for the process's life (like rift_ada.hf's self-drafters): one adapter per model, loaded once.
_ADAPTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# --- a prompt set ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TableSpec:
    """One table to build: its file name (without suffix), the prompt and the continuation's sampling seed."""

    name: str
    prompt: tuple
    seed: int


@dataclass(frozen=True)
class Builder:
    """Everything a process needs to build tables: the pair by the names ``load_pair`` takes, and the settings."""

    target: str
    drafter: str
    layout: CacheLayout
    decoding: Decoding
    max_new_tokens: int
    device: str = "cpu"
    dtype: str | None = None
    threads: int = 1
    draft_adapter: str | None = None  # a LoRA adapter folder for the draft (:func:`with_adapter`)

    def expected(self, pair, spec: TableSpec) -> dict:
        """The header fields a table of ``spec`` built by this builder holds (a stored one is reused only if they
        match)."""
        return {"target": model_fingerprint(pair.target), "draft": draft_fingerprint(pair.draft),
                "layout": layout_dict(self.layout), "temperature": float(self.decoding.temperature),
                "top_k": int(self.decoding.top_k), "top_p": float(self.decoding.top_p), "seed": int(spec.seed),
                "grid": self.layout.refresh_grid, "max_new_tokens": int(self.max_new_tokens),
                "prompt_sha": prompt_sha(spec.prompt)}

    def build(self, pair, spec: TableSpec, folder: Path) -> Path:
        from dataclasses import replace

        decoding = replace(self.decoding, seed=spec.seed)
        tokens, p = self.continuation(pair, spec, decoding, folder)
        table = build_table(pair.target, pair.draft, list(spec.prompt), self.layout, decoding, self.max_new_tokens,
                            pair.tokenizer.eos_token_id, (self.target, self.drafter), tokens=tokens, p=p)
        return table.save(folder / f"{spec.name}.safetensors")

    def continuation(self, pair, spec: TableSpec, decoding: Decoding, folder: Path) -> tuple[list, np.ndarray]:
        """The target's continuation of ``spec``'s prompt and its probabilities, stored first in
        ``<name>.continuation.npz`` (at long contexts the decode is most of a table's time: a build stopped in its
        rows, or one for another layout, starts from there). Reused only for the same pair, prompt and sampling."""
        path = folder / f"{spec.name}.continuation.npz"
        key = json.dumps({**{k: v for k, v in self.expected(pair, spec).items() if k not in ("layout", "grid")},
                          "draft_length": decoding.draft_length}, sort_keys=True)
        if path.is_file():
            with np.load(path) as z:
                if str(z["key"]) == key:
                    return z["tokens"].tolist(), z["p"]
        tokens = continuation(pair.target, pair.draft, list(spec.prompt), self.max_new_tokens, decoding,
                              pair.tokenizer.eos_token_id)
        ids = torch.tensor([list(spec.prompt) + tokens], device=pair.target.device)
        p = target_probs(pair.target, ids, len(spec.prompt), decoding).float().cpu().numpy()
        atomic_write(path, lambda tmp: np.savez(tmp, key=np.array(key), tokens=np.asarray(tokens, dtype=np.int64),
                                                p=p))
        return tokens, p


def prompt_sha(prompt_ids) -> str:
    return hashlib.sha256(np.asarray(list(prompt_ids), dtype=np.int64).tobytes()).hexdigest()[:16]


def stored(path: Path, expected: dict) -> ReplayTable | None:
    """The table ``path`` holds if it has the ``expected`` header fields (a resumed build keeps it), else None."""
    if not path.is_file():
        return None
    try:
        table = ReplayTable.load(path)
        table.check(**expected)
    except ValueError:
        return None
    return table


def build_tables(builder: Builder, specs: Sequence[TableSpec], folder, pair=None, workers: int = 1,
                 progress: bool | str = True) -> list[Path]:
    """A table per spec in ``folder`` (``<name>.safetensors``), built by ``builder``. Tables already there with the
    same models, settings, prompt and seed are kept (an interrupted build resumes); the rest are built one per
    process: ``workers`` processes here (each loading the pair once), or shared out strided under torchrun (after
    ``rift_ada.distributed.init``; every process returns every path once all are written). ``pair``: the loaded
    models, for building in this process and for checking stored tables (loaded from the builder's names if
    None; the builder's ``draft_adapter`` applied to it either way, :func:`with_adapter`)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    import multiprocessing

    from tqdm.auto import tqdm

    from .. import distributed

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pair = _worker_pair(builder) if pair is None else with_adapter(pair, builder.draft_adapter)
    paths = [folder / f"{s.name}.safetensors" for s in specs]
    todo = [i for i, (s, p) in enumerate(zip(specs, paths)) if not stored(p, builder.expected(pair, s))]
    todo = distributed.broadcast(todo)  # rank 0's view, before any process writes: every table built exactly once
    mine = [i for _, i in distributed.shard(todo)]
    desc = progress if isinstance(progress, str) else "replay tables"
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc=desc,
               disable=not progress or not distributed.is_main())
    if workers <= 1 or len(mine) <= 1:
        for i in mine:
            builder.build(pair, specs[i], folder)
            bar.update(distributed.world_size())
    else:
        ctx = multiprocessing.get_context("forkserver")
        with ProcessPoolExecutor(min(workers, len(mine)), mp_context=ctx, initializer=_start,
                                 initargs=(builder,)) as pool:
            for fut in as_completed([pool.submit(_build_one, specs[i], str(folder)) for i in mine]):
                fut.result()
                bar.update()
    bar.close()
    distributed.barrier()
    return paths


_PAIR = None


def _worker_pair(builder: Builder):
    from ..models import load_pair

    pair = load_pair(builder.target, builder.drafter, device=builder.device, dtype=builder.dtype)
    return with_adapter(pair, builder.draft_adapter)


def _start(builder: Builder) -> None:
    global _PAIR, _BUILDER
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(builder.threads)
    _PAIR, _BUILDER = _worker_pair(builder), builder


_BUILDER = None


def _build_one(spec: TableSpec, folder: str) -> str:
    return str(_BUILDER.build(_PAIR, spec, Path(folder)))
