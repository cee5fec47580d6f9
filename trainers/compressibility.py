"""Compressibility training: LoRA distillation of a draft under the sparse attention RIFT gives it at inference.

Pieces, in the order a training step uses them:
1. **Target outputs** (precomputed once, reusable): continuation tokens and the target's top-k log-probabilities.
   Format (a folder): ``meta.json`` ({"format": FORMAT, "target", "top_k", "temperature", "samples",
   "vocab_size", "continuation_tokens"}) and ``samples.pt``, a list of dicts with ``prompt_ids`` (P,) and
   ``continuation_ids`` (C,) int64, ``topk_ids`` (C, k) int64 and ``topk_logprobs`` (C, k) float32, where row i is
   the target's distribution over continuation token i (its logits at position P - 1 + i). While building, finished
   prompts wait in ``samples.partial.pt`` (an interrupted build resumes there). Under torchrun each process
   generates its strided share of the prompts and rank 0 writes the very files one process writes.
2. **Frozen scoring pass**: the draft with adapters disabled runs densely over prompt + continuation, recording
   post-RoPE keys and queries; the inference scorer (``select_importance``) picks each layer's importance
   positions per KV head, once after the prompt (RIFT-stat) or again every ``period`` tokens (RIFT-dyn).
3. **Masks**: prompt rows are causal (prefill is dense); continuation row t sees the selection in force at t plus
   the window band [t - window, t]: what a RiftCache compacted after every token shows token t (a round's
   in-flight tokens at inference widen the band by up to k + 1; the masks take the narrower, per-token view).
   Each sample draws its budget from a set of fractions of the prompt (the multi-budget recipe: one adapter for
   every budget used at inference), or trains on the full cache (``dense_share``, which keeps the full-cache
   acceptance).
4. **Masked pass** with the adapters on (the prompt prefilled without gradient, the continuation with gradient:
   :func:`continuation_logits`); the acceptance-aware loss (:func:`acceptance_loss`): KL(target || draft) on the
   target's top-k support plus one bucket for the remaining mass, weighted towards the positions the compressed
   draft gets rejected at, plus the rejection probability itself. Every step records the acceptance probability
   sum(min(p, q)) (temperature 1) and top-1 agreement (temperature 0) of the compressed and the dense samples.

Data parallel (torchrun, :mod:`rift_ada.distributed`): an optimizer step's ``grad_accum`` samples (the global batch,
the same as in one process) are split evenly across the processes, their LoRA gradients summed, and rank 0 alone
writes checkpoints and logs. The loss curve equals one process's up to floating-point summation order.

Files read back (target outputs, checkpoints) hold tensors and plain values only and are read with
``torch.load(weights_only=True)`` (:func:`rift_ada.files.read_torch`): a pickle planted in their place is refused
before any of its code runs. The held-out evaluation is :mod:`rift_ada.trainers.compressibility_eval`.
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rift_ada import distributed
from rift_ada.attention import use_rift_attention
from rift_ada.cache import RiftCache, RiftLayer
from rift_ada.layout import CacheLayout
from rift_ada.selection import observation_window, select_importance
from rift_ada.files import read_torch
from rift_ada.resume import atomic_write, write_json


FORMAT = "rift-ada/target-logits-v1"
# The training prompts' task formats: every format the evaluation asks for.
TRAIN_FAMILIES = ("low", "sort", "mixed", "high")


# --- 1. target outputs -----------------------------------------------------------------------------------------------
@torch.inference_mode()
def build_target_outputs(target, prompts: list[list[int]], continuation_tokens: int, folder: str | Path,
                         top_k: int = 32, temperature: float = 0.0, seed: int = 0, target_name: str = "",
                         progress: bool = True, extra_meta: dict | None = None) -> Path:
    """Generate each prompt's continuation with the target (greedy, or sampled at ``temperature``) and store it
    with the target's top-k log-probabilities (at temperature 1: the distribution the draft learns).

    Resumable: finished prompts go to ``samples.partial.pt`` as they end, and a rerun with the same prompts and
    settings continues after them (each prompt's sampling seed is drawn up front, so it does not depend on where a
    run stopped). ``meta.json`` is written last: it marks a complete folder.

    Under torchrun (once ``rift_ada.distributed.init`` has joined the group; every process calls this with the same
    arguments) the prompts are shared out strided, as :func:`rift_ada.distributed.shard` does: in each round of W
    prompts (W processes) process r generates prompt ``start + r``; the round's samples are gathered and rank 0
    appends them, in prompt order, to the partial file. So the files (and a resume from them, by any number of
    processes) are those of one process; the others return once rank 0 has written ``meta.json``."""
    folder = Path(folder)
    world, rank, main = distributed.world_size(), distributed.rank(), distributed.is_main()
    if main:
        folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    seeds = [int(torch.randint(2**31, (1,), generator=g)) for _ in prompts]
    settings = {"target": target_name, "top_k": top_k, "temperature": temperature, "seed": seed,
                "continuation_tokens": continuation_tokens}
    partial = folder / "samples.partial.pt"
    samples, done = [], 0
    if main:  # only rank 0 reads and writes the files; the others learn where to start from it
        saved = read_torch(partial, "a partial target-output file") if partial.is_file() else {}
        samples = saved.get("samples", []) if saved.get("settings") == settings else []
        while done < min(len(samples), len(prompts)) and samples[done]["prompt_ids"].tolist() == list(prompts[done]):
            done += 1  # the stored prefix that belongs to these prompts
        samples = samples[:done]
    done = distributed.broadcast(done)
    bar = tqdm(total=len(prompts), initial=done, desc="target outputs", disable=not progress or not main)
    for start in range(done, len(prompts), world):
        mine = []
        if start + rank < len(prompts):
            i = start + rank
            with distributed.on_shard(i):
                mine.append((rank, _target_sample(target, prompts[i], continuation_tokens, top_k, temperature,
                                                  seeds[i])))
        finished = distributed.gather(mine)  # this round's samples, in prompt order
        if main:
            samples.extend(finished)
            atomic_write(partial, lambda tmp: torch.save({"settings": settings, "samples": samples}, tmp))
        bar.update(len(finished))
    bar.close()
    if main:
        atomic_write(folder / "samples.pt", lambda tmp: torch.save(samples, tmp))
        meta = {"format": FORMAT, "target": target_name, "top_k": top_k, "temperature": temperature,
                "samples": len(samples), "vocab_size": target.config.vocab_size,
                "continuation_tokens": continuation_tokens, **(extra_meta or {})}
        write_json(folder / "meta.json", meta)
        partial.unlink(missing_ok=True)
    distributed.barrier()  # the folder is complete before any process reads it
    return folder


def _target_sample(target, ids: list[int], continuation_tokens: int, top_k: int, temperature: float,
                   seed: int) -> dict:
    """One prompt's stored sample: the target's continuation and its top-k log-probabilities (see the format)."""
    x = torch.tensor([ids], device=target.device)
    kw = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    if temperature > 0:
        torch.manual_seed(seed)
    out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=continuation_tokens,
                          eos_token_id=None, pad_token_id=0, **kw)
    cont = out[0, len(ids):]
    logits = target(out, logits_to_keep=len(cont) + 1).logits[0, :len(cont)].float()
    logp = torch.log_softmax(logits, -1)
    top = logp.topk(top_k, dim=-1)
    return {"prompt_ids": torch.tensor(ids), "continuation_ids": cont.cpu(), "topk_ids": top.indices.cpu(),
            "topk_logprobs": top.values.cpu()}


def load_target_outputs(folder: str | Path, vocab_size: int | None = None) -> tuple[dict, list[dict]]:
    folder = Path(folder)
    if not (folder / "meta.json").is_file() or not (folder / "samples.pt").is_file():
        raise FileNotFoundError(f"no target outputs in {str(folder)!r} (expected meta.json and samples.pt; build them "
                                "with experiments/train_compressibility.py --build-targets-only)")
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}: unknown target-output format {meta.get('format')!r} (expected {FORMAT!r})")
    if vocab_size is not None and meta["vocab_size"] != vocab_size:
        raise ValueError(f"{folder} holds logits over {meta['vocab_size']} tokens, the draft has {vocab_size}")
    samples = read_torch(folder / "samples.pt", "a target-output file")
    if not isinstance(samples, list) or len(samples) != meta["samples"]:
        held = f"{len(samples)} samples" if isinstance(samples, list) else f"a {type(samples).__name__}"
        raise ValueError(f"{folder}: meta.json lists {meta['samples']} samples, samples.pt holds {held}")
    return meta, samples


def prompt_outputs(target, prompts: list[list[int]], new_tokens: int, target_name: str,
                   folder: str | Path | None = None) -> list[dict]:
    """The target's outputs (greedy continuations of ``new_tokens`` and top-k log-probabilities) for exactly these
    ``prompts``: read from ``folder`` when it holds them (ValueError if it holds other prompts' or lengths'), else
    built there; ``folder`` None: built in a temporary folder and kept in memory only. The held-out studies' store
    (``experiments/compressed_agreement.py``, ``experiments/compression_gap.py``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        where = folder or tmp
        try:
            _, samples = load_target_outputs(where, vocab_size=target.config.vocab_size)
            if [s["prompt_ids"].tolist() for s in samples] != prompts or \
                    len(samples[0]["continuation_ids"]) != new_tokens:
                raise ValueError(f"{where} holds the target outputs of other prompts: delete it or choose another")
        except FileNotFoundError:
            build_target_outputs(target, prompts, new_tokens, where, target_name=target_name)
            _, samples = load_target_outputs(where)
    return samples


def training_tasks(tokenizer, n: int, input_tokens: int, seed: int,
                   families: tuple[str, ...] = TRAIN_FAMILIES) -> list:
    """The training prompts: the task ``families`` (default every format the evaluation asks for, interleaved so
    that any prefix holds all of them), built from the standard library's training split, never from the eval split."""
    from rift_ada.data import build_tasks

    per = -(-n // len(families))
    # A family's seed is its place in TRAIN_FAMILIES, so its prompts do not depend on which others are drawn.
    built = [build_tasks(tokenizer, f, n=per, input_tokens=input_tokens, seed=seed + 100 + TRAIN_FAMILIES.index(f),
                         split="train")
             for f in tqdm(families, desc="building prompts", disable=not distributed.is_main())]
    return [fam[i] for i in range(per) for fam in built][:n]


def target_outputs(pair, folder: str | Path, given: bool, target_name: str, prompts: int, input_tokens: int,
                   continuation_tokens: int, top_k: int, temperature: float, seed: int,
                   families: tuple[str, ...] = TRAIN_FAMILIES) -> list[dict]:
    """The target's outputs to distil, from ``folder``: ``given`` ones (FileNotFoundError if missing), or built there
    from ``prompts`` training prompts (:func:`training_tasks`; sharded under torchrun) unless a previous run built
    them with the same settings; ones built with other settings are refused (ValueError)."""
    from rift_ada.data import encode_prompts

    folder = Path(folder)
    if not (folder / "meta.json").is_file():
        if given:
            raise FileNotFoundError(f"no target outputs in {str(folder)!r} (meta.json missing)")
        tasks = training_tasks(pair.tokenizer, prompts, input_tokens, seed, families)
        build_target_outputs(pair.target, encode_prompts(pair.tokenizer, tasks), continuation_tokens, folder, top_k,
                             temperature, seed, target_name,
                             extra_meta=None if tuple(families) == TRAIN_FAMILIES else {"families": list(families)})
    meta, samples = load_target_outputs(folder, vocab_size=pair.draft.config.vocab_size)
    want = {"target": target_name, "top_k": top_k, "temperature": temperature,
            "continuation_tokens": continuation_tokens, "samples": prompts}
    if tuple(families) != TRAIN_FAMILIES:  # the default leaves older folders' meta.json valid
        want["families"] = list(families)
    diff = [f"{k} {meta.get(k)!r} -> {v!r}" for k, v in want.items() if meta.get(k) != v]
    if diff and not given:  # an older run's, in the output folder
        raise ValueError(f"{folder} holds target outputs built with other settings ({'; '.join(diff)}); delete it, "
                         "or choose another --output-dir")
    return samples


# --- 2./3. selections and masks -----------------------------------------------------------------------------------
def sample_layout(prompt_len: int, budgets: tuple[float, ...], rng: random.Random, window_fraction: float = 0.5,
                  obs_window: int = 32, scorer: str = "snapkv", lookahead: int = 64) -> CacheLayout:
    """The RIFT layout of one training sample: a budget drawn from ``budgets`` (fractions of the prompt: the
    multi-budget recipe, one adapter for every budget used at inference), split as at inference."""
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise ValueError(f"budgets are fractions of the prompt in (0, 1], got {list(budgets)}")
    budget = max(2, round(budgets[rng.randrange(len(budgets))] * prompt_len))
    return CacheLayout("rift", budget=budget, window_fraction=window_fraction, obs_window=obs_window, scorer=scorer,
                       lookahead=lookahead)


@torch.no_grad()
def dense_capture(model, ids: torch.Tensor) -> RiftCache:
    """One dense forward that records every layer's post-RoPE keys and queries (capacity for all positions)."""
    use_rift_attention(model)
    n = ids.shape[1]
    # The model's own layer kinds: a hybrid's linear-attention layers keep their states (they are never masked).
    cache = RiftCache.for_config(model.config, CacheLayout("full"), extra_queries=n)
    model(ids, cache=cache, position_ids=torch.arange(n, device=ids.device)[None], rift_observer=cache,
          logits_to_keep=1)
    return cache


def selections(cache: RiftCache, prompt_len: int, total_len: int, layout: CacheLayout,
               period: int | None = None) -> list[list[tuple[int, torch.Tensor]] | None]:
    """Per layer: [(start, positions (batch, kv_heads, n))] with the selection made at ``start`` (the prompt end,
    then every ``period`` tokens for RIFT-dyn), through the same layout and function the inference cache uses;
    None for a layer the budget does not apply to (linear-attention, cache-free and sliding layers)."""
    scorer = layout.make_scorer()
    starts = [prompt_len]
    if period:
        starts += list(range(prompt_len + period, total_len, period))
    out = []
    for layer in cache.layers:
        if not isinstance(layer, RiftLayer):
            out.append(None)
            continue
        out.append([(s, select_importance(scorer, layer.keys, s, layout.n_imp, layout.tail_keep,
                                          *observation_window(layer.queries[:, :, :s], layer.query_pos[:s],
                                                              layout.obs_window)))
                    for s in starts])
    return out


def build_masks(total_len: int, prompt_len: int, layer_selections, window: int, device=None) -> list[torch.Tensor]:
    """Per layer (batch, kv_heads, T, T) bool: causal prompt rows; continuation rows see the window band and the
    importance positions of the selection in force. None where a layer has no selection (it is not masked)."""
    t = torch.arange(total_len, device=device)[:, None]
    j = torch.arange(total_len, device=device)[None, :]
    causal = j <= t
    band = causal & (j >= t - window)
    masks = []
    for sels in layer_selections:
        if sels is None:
            masks.append(None)
            continue
        b, h = sels[0][1].shape[:2]
        m = causal.expand(b, h, total_len, total_len).clone()
        m[:, :, prompt_len:] = band[prompt_len:]
        ends = [s for s, _ in sels[1:]] + [total_len]
        for (start, pos), end in zip(sels, ends):
            imp = torch.zeros(b, h, total_len, dtype=torch.bool, device=device)
            imp.scatter_(2, pos.to(device), True)
            m[:, :, start:end] |= imp[:, :, None, :]  # selected positions precede start - window: causal already
        masks.append(m)
    return masks


def compressed_masks(model, ids: torch.Tensor, prompt_len: int, layout: CacheLayout,
                     period: int | None = None) -> list[torch.Tensor]:
    """``model``'s own selection on ``ids`` (one dense pass; RIFT-stat, or RIFT-dyn every ``period`` tokens) as the
    per-layer masks of what its compressed cache shows each continuation token."""
    n = ids.shape[1]
    sels = selections(dense_capture(model, ids), prompt_len, n, layout, period)
    return build_masks(n, prompt_len, sels, layout.tail_keep, ids.device)


# --- 4. loss ------------------------------------------------------------------------------------------------------------
def position_acceptance(draft_logits: torch.Tensor, topk_ids: torch.Tensor,
                        topk_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: a = sum(min(p, q)) on the target's top-k support (temperature 1's acceptance probability, a
    lower bound) and whether the draft's argmax is the target's (temperature 0's acceptance)."""
    logq = torch.log_softmax(draft_logits.float(), -1)
    accept = torch.minimum(topk_logprobs.float().exp(), logq.gather(-1, topk_ids).exp()).sum(-1)
    return accept, (logq.argmax(-1) == topk_ids[:, 0]).float()


def acceptance_loss(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                    accept_weight: float = 0.0, tv_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Acceptance-aware distillation loss and what it is judged by.

    Per position: KL(p || q) on the target's top-k support plus one bucket for the rest of the mass, and the
    acceptance probability a = sum_x min(p(x), q(x)) (on the top-k support: a lower bound), the chance that the
    exact rejection rule at temperature 1 keeps a drafted token. The loss is the KL averaged with weights
    1 + accept_weight * (1 - a) (a detached): the positions where the compressed draft is rejected count more,
    which is what acceptance length is made of; plus tv_weight * mean(1 - a), the rejection probability itself.
    (KL alone is minimised by a calibrated draft; where the target is sure, 1 - a is minimised by a draft as sure
    as it can be of its best guess, which is what sampling at temperature 1 accepts.) Metrics: ``kl``, ``accept`` (mean a) and ``top1`` (the draft's
    argmax is the target's: acceptance at temperature 0)."""
    logq = torch.log_softmax(draft_logits.float(), -1)
    q_top = logq.gather(-1, topk_ids)
    p_top = topk_logprobs.float()
    p_rest = (1 - p_top.exp().sum(-1)).clamp_min(1e-8)
    q_rest = (1 - q_top.exp().sum(-1)).clamp_min(1e-8)
    kl = (p_top.exp() * (p_top - q_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    accept, top1 = position_acceptance(draft_logits, topk_ids, topk_logprobs)
    w = 1 + accept_weight * (1 - accept.detach())
    loss = (w * kl).sum() / w.sum() + tv_weight * (1 - accept).mean()
    return loss, {"kl": kl.mean().item(), "accept": accept.mean().item(), "top1": top1.mean().item()}


def topk_kl(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q) on the target's top-k support plus a bucket for the rest of the mass."""
    return acceptance_loss(draft_logits, topk_ids, topk_logprobs)[0]


def masked_logits(model, ids: torch.Tensor, masks: list[torch.Tensor], prompt_len: int) -> torch.Tensor:
    """Logits at the positions that predict the continuation, under the per-layer masks (one full-sequence pass)."""
    n = ids.shape[1]
    out = model(input_ids=ids, position_ids=torch.arange(n, device=ids.device)[None], rift_masks=masks,
                use_cache=False)
    return out.logits[0, prompt_len - 1:n - 1]


def continuation_logits(model, ids: torch.Tensor, masks: list[torch.Tensor] | None, prompt_len: int) -> torch.Tensor:
    """:func:`masked_logits`, computed as the decoder does: the prompt prefilled without gradient (its rows are
    causal in every mask: the compressed cache's prefill is dense), then the continuation on that cache under the
    masks' continuation rows. The same logits; gradients reach the adapter through the continuation's own positions
    only (the prompt's keys and values are constants), so the backward pass costs C x (P + C) attention scores and C
    tokens of MLP instead of (P + C)^2 and P + C: about 4x less time per 2K sample on a CPU. Models with
    linear-attention layers take the full-sequence pass (their states would need a hybrid cache here).
    ``masks`` None: the full cache (a dense sample)."""
    from transformers import DynamicCache

    from rift_ada.architectures import layer_kinds

    n, start = ids.shape[1], prompt_len - 1
    if any(k.kind != "full" for k in layer_kinds(model.config)):
        if masks is None:
            return model(input_ids=ids, use_cache=False).logits[0, start:n - 1]
        return masked_logits(model, ids, masks, prompt_len)
    pos = torch.arange(n, device=ids.device)[None]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :start], position_ids=pos[:, :start], cache=cache, use_cache=True, logits_to_keep=1)
    rows = None if masks is None else [None if m is None else m[:, :, start:n - 1, :n - 1] for m in masks]
    out = model(input_ids=ids[:, start:n - 1], position_ids=pos[:, start:n - 1], cache=cache, use_cache=True,
                rift_masks=rows)
    return out.logits[0]


HINDSIGHT = "hindsight"  # a sample's selection: the full-cache model's own top keys at each row (compression_gap)


def sample_loss(model, sample: dict, layout: CacheLayout | None, period: int | str | None = None,
                accept_weight: float = 0.0, tv_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """One sample: frozen dense scoring pass (adapters off), masks, masked pass (adapters on), acceptance-aware loss.
    ``layout`` None: a dense sample (the full cache, no selection). ``period``: None for RIFT-stat's selection, N for
    RIFT-dyn's every N tokens, or HINDSIGHT for the hindsight selection of ``layout.budget`` keys per row (what
    reading a compressed cache costs with the best selection there is: ``trainers.compression_gap``)."""
    device = next(model.parameters()).device
    ids = torch.cat([sample["prompt_ids"], sample["continuation_ids"]]).to(device)[None]
    p = len(sample["prompt_ids"])
    masks = None
    if layout is not None:
        with model.disable_adapter():
            if period == HINDSIGHT:
                from rift_ada.trainers.compression_gap import hindsight_masks  # it builds on this module

                masks = hindsight_masks(model, ids, p, layout.budget)
            else:
                masks = compressed_masks(model, ids, p, layout, period)
    logits = continuation_logits(model, ids, masks, p)
    return acceptance_loss(logits, sample["topk_ids"].to(device), sample["topk_logprobs"].to(device), accept_weight,
                           tv_weight)


def sample_order(n: int, seed: int, index: int) -> int:
    """The sample used at global position ``index``: a fresh permutation per epoch, fixed by (seed, epoch), so a
    resumed run sees exactly the samples an uninterrupted one would."""
    epoch, i = divmod(index, n)
    perm = list(range(n))
    random.Random(f"{seed}/{epoch}").shuffle(perm)
    return perm[i]


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def option_problem(args, default_drafter: str) -> str | None:
    """The one-line problem with a training run's budgets, shares and drafter (``--self``), or None."""
    for name in ("budgets", "eval_budgets"):
        flag, values = "--" + name.replace("_", "-"), getattr(args, name)
        if any(not 0 < b <= 1 for b in values):
            return f"{flag} are fractions of the input in (0, 1]"
        if small := [b for b in values if round(b * args.input_tokens) < 2]:
            return (f"{flag} {small[0]:g} keeps {round(small[0] * args.input_tokens)} of the {args.input_tokens}-token "
                    "prompts' tokens: a RIFT cache holds at least 2 (one selected, one in the window)")
    for name in ("dense_share", "dyn_share", "hindsight_share"):
        if not 0 <= getattr(args, name) <= 1:
            return f"--{name.replace('_', '-')} is a share in [0, 1]"
    if args.accept_weight < 0 or args.tv_weight < 0:
        return "--accept-weight and --tv-weight must be >= 0"
    if getattr(args, "self", False) and args.drafter not in ("self", default_drafter):
        from rift_ada.models import drafter_model

        if drafter_model(args.drafter) != args.target:
            return f"--self trains the target as its own drafter; --drafter {args.drafter} names another model"
    return None


# --- the training loop -------------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    steps: int = 100
    lr: float = 5e-4
    warmup: int = 10
    grad_accum: int = 2
    budgets: tuple[float, ...] = (0.0625, 0.125, 0.25, 0.5)  # drawn per sample, as fractions of the prompt
    dense_share: float = 0.25  # share of samples trained on the full cache (keeps the full-cache acceptance)
    accept_weight: float = 4.0  # acceptance-aware weighting of the KL (acceptance_loss)
    tv_weight: float = 1.0  # weight of the rejection probability in the loss (acceptance_loss)
    window_fraction: float = 0.5
    obs_window: int = 32
    scorer: str = "snapkv"
    lookahead: int = 64
    dyn_share: float = 0.25  # share of the compressed samples trained with RIFT-dyn re-selection
    hindsight_share: float = 0.0  # share of the compressed samples trained under the hindsight selection
    period: int = 32
    checkpoint_every: int = 25
    seed: int = 0


def draw_sample(cfg: TrainConfig, samples: list[dict], index: int) -> tuple[dict, CacheLayout | None,
                                                                            int | str | None]:
    """The sample at global position ``index`` and how it is masked: (sample, layout or None for the full cache,
    RIFT-dyn period, HINDSIGHT or None for RIFT-stat), all drawn from (seed, index) alone."""
    sample = samples[sample_order(len(samples), cfg.seed, index)]
    rng = random.Random(f"{cfg.seed}/spec/{index}")
    if rng.random() < cfg.dense_share:
        return sample, None, None
    dyn = rng.random() < cfg.dyn_share
    layout = sample_layout(len(sample["prompt_ids"]), cfg.budgets, rng, cfg.window_fraction, cfg.obs_window,
                           cfg.scorer, cfg.lookahead)
    # Drawn last and only when asked for, so runs without hindsight samples see the very sequence they saw before.
    if cfg.hindsight_share and rng.random() < cfg.hindsight_share:
        return sample, layout, HINDSIGHT
    return sample, layout, cfg.period if dyn else None


def train(model, samples: list[dict], cfg: TrainConfig, output_dir: str | Path, resume: bool = True, log=None,
          stop_after: int | None = None, progress: bool = True, eval_fn=None, eval_every: int = 0) -> dict:
    """LoRA training of ``model`` (a peft model) on ``samples``. Checkpoints (adapter, optimizer, step) go to
    ``output_dir/checkpoints/step-N`` every ``checkpoint_every`` steps; with ``resume`` the latest is loaded and
    training continues at the next step with the same samples it would have seen. ``stop_after`` ends the run
    after that step (simulating an interruption). ``eval_fn(model) -> dict`` (held-out acceptance lengths, say) runs
    before the first step and every ``eval_every`` steps; its results go to ``log`` and to the returned ``evals``
    (kept in checkpoints, so a resumed run's curve is whole). Under torchrun every process calls it (it may be
    collective, as evaluate() is).

    Under torchrun (once ``rift_ada.distributed.init`` has joined the group; every process calls this with the same
    model, samples and settings) the global batch stays ``grad_accum`` samples per optimizer step: process r of W
    takes the step's samples ``r * grad_accum / W`` .. ``(r + 1) * grad_accum / W - 1`` of the very sequence one
    process sees (``sample_order`` and the per-sample layout draws are indexed globally), and ValueError if
    ``grad_accum`` is not a multiple of W. Every process ends with the same adapter and history; rank 0 alone writes
    checkpoints, calls ``log`` and shows progress. Every process resumes from the checkpoint rank 0 finds."""
    world, main = distributed.world_size(), distributed.is_main()
    if cfg.grad_accum % world:
        raise ValueError(f"--grad-accum {cfg.grad_accum} (samples per optimizer step, the global batch) is not a "
                         f"multiple of the {world} torchrun processes: each process takes an equal share")
    ckpt_dir = Path(output_dir) / "checkpoints"
    if main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    log = log if main else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    start, history, evals = _resume(model, opt, ckpt_dir, resume)
    # Data parallel: every process must start from the same adapter (a fresh one is seeded alike; this makes sure).
    with torch.no_grad():
        distributed.broadcast_(params)
    if eval_every and start == 0:
        _evaluate_at(0, model, eval_fn, evals, log)  # the untrained draft's point (a resumed run has it already)
    model.train()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="LoRA compressibility",
               disable=not progress or not main)
    for step in bar:
        entry = _optimizer_step(model, params, opt, samples, cfg, step)
        history.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.4f}")
        if log is not None:
            log({f"lora/{k}": v for k, v in entry.items() if k != "step"} | {"lora/step": step + 1})
        if eval_every and (step + 1) % eval_every == 0:
            _evaluate_at(step + 1, model, eval_fn, evals, log)
        stop = stop_after is not None and step + 1 >= stop_after
        if main and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps or stop):
            save_checkpoint(ckpt_dir, {"adapter": _adapter_state(model), "optimizer": opt.state_dict(),
                                       "step": step + 1, "history": history, "evals": evals})
        if stop:
            break
    model.eval()
    return {"history": history, "evals": evals, "steps_done": history[-1]["step"] if history else start}


def train_adapter(base, samples: list[dict], cfg: TrainConfig, output_dir: str | Path, rank: int = 8,
                  modules=None, layers: list[int] | None = None, in_place: bool = False,
                  **train_kw) -> tuple[object, dict]:
    """A LoRA adapter (``rift_ada.lora.attach``: ``rank``, alpha 2 x rank, ``modules`` or every linear layer,
    ``layers`` or all) on a copy of ``base``, trained by :func:`train` (``train_kw``) and saved to
    ``output_dir/adapter`` with ``base``'s fingerprint (by rank 0). ``in_place``: in ``base``'s own modules, no copy
    (a self-drafter: the target is the base, and it verifies with the adapter switched off, as
    ``rift_ada.lora.load_self_drafter`` leaves it; it is switched off here after training). Returns (the adapted
    model, :func:`train`'s record)."""
    from rift_ada import lora

    fingerprint = lora.fingerprint(base)  # before any LoRA layer goes in
    torch.manual_seed(cfg.seed)  # the adapter's initialisation
    student = lora.attach(base if in_place else copy.deepcopy(base), rank=rank, alpha=2 * rank,
                          target_modules=modules or lora.DEFAULT_TARGET_MODULES, layers=layers)
    trained = train(student, samples, cfg, output_dir, **train_kw)
    if in_place:
        lora.AdapterSwitch(student).set(False)  # the base is the target again; decoders switch it on to draft
    if distributed.is_main():
        lora.save(student, fingerprint, Path(output_dir) / "adapter")
    return student, trained


def _optimizer_step(model, params: list, opt, samples: list[dict], cfg: TrainConfig, step: int) -> dict:
    """Optimizer step ``step`` over the global batch's samples (this process's share of them under torchrun); its
    history entry (the loss summed over the batch, the lr, and the compressed and dense samples' metrics)."""
    world, rank = distributed.world_size(), distributed.rank()
    per_rank = cfg.grad_accum // world
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.warmup)
    opt.zero_grad(set_to_none=True)
    losses = []  # (position in the step, this process's sample losses and metrics): all of them in one process
    for micro in range(rank * per_rank, (rank + 1) * per_rank):
        index = step * cfg.grad_accum + micro
        sample, layout, period = draw_sample(cfg, samples, index)
        with distributed.on_shard(index):
            # Divided by the global batch: the step's loss (and gradient) is the mean over all its samples.
            loss, metrics = sample_loss(model, sample, layout, period, cfg.accept_weight, cfg.tv_weight)
            (loss / cfg.grad_accum).backward()
        losses.append((micro, {"loss": loss.item() / cfg.grad_accum, "dense": layout is None, **metrics}))
    if world > 1:
        # Data parallel by hand rather than DistributedDataParallel. The gradient one process accumulates is
        # sum_i grad(loss_i / grad_accum) over the step's samples; summing the processes' partial sums gives that
        # very gradient (up to summation order), whereas DDP *averages* over processes, so the losses would have
        # to be scaled by W to compensate. DDP would also wrap the peft model (sample_loss calls its
        # disable_adapter() for the frozen scoring pass), need no_sync() for every sample but the last, and
        # overlap communication with a backward pass whose LoRA gradients are small: one flat all-reduce per
        # optimizer step is simpler and as fast. Clipping and AdamW then see the same gradient on every process,
        # so the adapters stay identical without further communication.
        for p in params:
            if p.grad is None:  # unused in this process's forwards: contributes zero
                p.grad = torch.zeros_like(p)
        distributed.all_reduce_sum_([p.grad for p in params])
    every = distributed.gather(losses)  # every sample's loss and metrics, in the step's order
    total = sum(m["loss"] for m in every)  # summed in one process's order
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    entry = {"step": step + 1, "loss": total, "lr": opt.param_groups[0]["lr"]}
    for kind, dense in (("compressed", False), ("dense", True)):  # the draft under RIFT masks / its full cache
        for key in ("accept", "top1", "kl"):
            vals = [m[key] for m in every if m["dense"] == dense]
            if vals:
                entry[f"{kind}_{key}"] = sum(vals) / len(vals)
    return entry


def _evaluate_at(step: int, model, eval_fn, evals: list[dict], log) -> None:
    """``eval_fn``'s point at ``step`` into ``evals`` and ``log``, unless there is one already (a resumed run's)."""
    if eval_fn is None or any(e["step"] == step for e in evals):
        return
    model.eval()
    result = {"step": step, **eval_fn(model)}
    model.train()
    evals.append(result)
    if log is not None:
        log({**{f"heldout/{k}": v for k, v in result.items() if k != "step"}, "lora/step": step})


# --- checkpoints -------------------------------------------------------------------------------------------------------
# ``checkpoints/step-N/state.pt``: {"adapter": the peft state dict, "optimizer": AdamW's state dict, "step": N,
# "history": [...], "evals": [...]}: tensors and plain values only, so resuming reads it with weights_only=True.
CHECKPOINT_KEYS = ("adapter", "optimizer", "step", "history")


def _adapter_state(model) -> dict:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (state.pt is written atomically, so one that exists is whole)."""
    return sorted((p for p in folder.glob("step-*") if (p / "state.pt").is_file()), key=lambda p: int(p.name[5:]))


def save_checkpoint(folder: Path, state: dict) -> Path:
    return atomic_write(folder / f"step-{state['step']}" / "state.pt", lambda tmp: torch.save(state, tmp))


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint :func:`save_checkpoint` wrote; ValueError (one line naming the file) for anything else, a
    planted pickle included (it is refused before any of its code runs)."""
    state = read_torch(path, "a compressibility training checkpoint")
    missing = [k for k in CHECKPOINT_KEYS if k not in state] if isinstance(state, dict) else list(CHECKPOINT_KEYS)
    if missing:
        raise ValueError(f"{path}: not a compressibility training checkpoint (it lacks {', '.join(missing)})")
    return state


def _resume(model, opt, ckpt_dir: Path, resume: bool) -> tuple[int, list, list]:
    """(start step, history, evals): the latest checkpoint rank 0 finds in ``ckpt_dir`` (``resume``), loaded into
    ``model`` and ``opt`` on every process (the folder is shared), or a fresh start."""
    from peft import set_peft_model_state_dict

    found = checkpoints(ckpt_dir) if resume and distributed.is_main() else []
    last = distributed.broadcast(str(found[-1]) if found else None)  # one checkpoint for all processes
    if last is None:
        return 0, [], []
    state = load_checkpoint(Path(last) / "state.pt")
    set_peft_model_state_dict(model, state["adapter"])
    opt.load_state_dict(state["optimizer"])
    return state["step"], state["history"], state.get("evals", [])
