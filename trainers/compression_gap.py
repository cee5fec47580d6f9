"""Where a compressed drafter's acceptance goes: *reading* a compressed cache vs *choosing* what it keeps.

A self-speculating drafter (the target drafting for itself from a RIFT-compressed cache, verified by the same
weights on the full cache) loses acceptance length (AL) for two reasons:

* **reading**: attention over a subset of the keys is not the attention the weights were trained for, whatever the
  subset; the softmax renormalises over what is left and the missing keys' values are gone. This part is what a LoRA
  on the drafter (``rift_ada.trainers.compressibility``) can recover: it teaches the weights to read such a cache.
* **selection**: which keys are kept. A scorer decides at the prompt end (RIFT-stat) or every ``period`` tokens
  (RIFT-dyn) from what it has seen so far.

The **hindsight** selection splits the two: for each continuation row t and each layer it keeps, per KV head, the
keys the *dense* model's attention at row t weights most (the probabilities of the query heads sharing that KV head,
summed over the group; keys 0..t). It knows the future query and picks per row and per layer, so no real scorer of
the same size can beat it: AL(full) - AL(hindsight) is the reading gap, AL(hindsight) - AL(rift) the selection gap.
(Top attention mass is the natural oracle, not a provably optimal one for the logits; it bounds what a scorer that
ranks keys by attention can reach.) Size: a RIFT row at budget B reads B + 1 keys (n_imp importance + the window
band [t - window, t], which includes the token itself), so :func:`gap_rows` gives hindsight B + 1 keys per row.

Everything is teacher-forced along the target's greedy continuation (the compressibility trainer's target outputs):
per position the acceptance probability sum(min(p, q)) on the target's top-k (temperature 1) and top-1 agreement
(temperature 0), turned into AL by :func:`rounds_al`. Position 0 of the continuation comes from the target's prefill
(it is not drafted; its row is a dense prompt row under every mask), so every statistic here is over positions
1..C-1. Masks (selections, hindsight attention) can come from one model (``scorer_model``: the unadapted base, the
full-cache model) and the logits from another (the drafter, LoRA-adapted or not).
"""

from __future__ import annotations

import math
import random

import torch
from tqdm.auto import tqdm

from rift_ada.cache import RiftLayer

from .compressibility import (build_masks, continuation_logits, dense_capture, position_acceptance, sample_layout,
                              selections)

SETTINGS = ("full", "rift-stat", "rift-dyn", "hindsight")
STATS = ("accept", "top1", "al_t1", "al_t0")
# Student-t 0.975 quantiles for 1..30 degrees of freedom (beyond: a Cornish-Fisher expansion around 1.96).
_T975 = (12.70620, 4.30265, 3.18245, 2.77645, 2.57058, 2.44691, 2.36462, 2.30600, 2.26216, 2.22814, 2.20099, 2.17881,
         2.16037, 2.14479, 2.13145, 2.11991, 2.10982, 2.10092, 2.09302, 2.08596, 2.07961, 2.07387, 2.06866, 2.06390,
         2.05954, 2.05553, 2.05183, 2.04841, 2.04523, 2.04227)


# --- hindsight masks --------------------------------------------------------------------------------------------------
def attention_scalings(model) -> dict[int, float]:
    """Per attention layer index: the factor its scores are scaled by (``module.scaling``, else head_dim ** -0.5)."""
    out = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and (hasattr(module, "scaling") or hasattr(module, "head_dim")):
            out[idx] = float(getattr(module, "scaling", None) or module.head_dim ** -0.5)
    return out


def group_attention(queries: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, scaling: float) -> torch.Tensor:
    """Dense causal attention probabilities (float32) of the query rows ``rows`` (absolute positions, queries
    (b, q_heads, T, d) holding every position), summed over each KV head's query group: (b, kv_heads, len(rows), T).
    Query head h reads KV head h // group, as transformers' repeat_kv pairs them. Plain softmax attention (no sinks,
    no softcapping)."""
    b, hq, _, d = queries.shape
    hk, n = keys.shape[1], keys.shape[2]
    q = queries[:, :, rows].float().reshape(b, hk, hq // hk, len(rows), d)
    scores = torch.einsum("bhgrd,bhjd->bhgrj", q, keys.float()) * scaling
    causal = torch.arange(n, device=keys.device)[None, :] <= rows[:, None].to(keys.device)
    return scores.masked_fill(~causal, float("-inf")).softmax(-1).sum(2)


@torch.no_grad()
def hindsight_masks(model, ids: torch.Tensor, prompt_len: int, budget: int, capture=None,
                    block: int = 64) -> list[torch.Tensor | None]:
    """Per layer (1, kv_heads, T, T) bool in :func:`build_masks`'s format: prompt rows causal; continuation row t
    keeps exactly min(budget, t + 1) keys per KV head, the ones the dense model's attention at row t (summed over the
    KV head's query group) weights most in that layer. ``capture``: ``dense_capture(model, ids)`` when already made
    (its post-RoPE queries and keys). Rows go ``block`` at a time, so the work memory is O(heads x block x T). Layers
    that are not RIFT layers (sliding, recurrent) get None, as in build_masks."""
    if budget < 1:
        raise ValueError(f"a hindsight selection keeps >= 1 key per row, got budget {budget}")
    capture = dense_capture(model, ids) if capture is None else capture
    scalings = attention_scalings(model)
    n, device = ids.shape[1], ids.device
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    out = []
    for i, layer in enumerate(capture.layers):
        if not isinstance(layer, RiftLayer):
            out.append(None)
            continue
        if len(layer.query_pos) != n or int(layer.query_pos[-1]) != n - 1:
            raise ValueError(f"layer {i}: the capture holds queries at {len(layer.query_pos)} positions, not all {n}")
        b, hk = layer.keys.shape[:2]
        m = causal.expand(b, hk, n, n).clone()
        for start in range(prompt_len, n, block):
            rows = torch.arange(start, min(start + block, n), device=device)
            probs = group_attention(layer.queries, layer.keys, rows, scalings[i])
            probs = probs.masked_fill(~causal[rows], -1.0)  # future keys rank below every causal one, zeros included
            top = probs.topk(min(budget, n), dim=-1).indices  # (b, kv_heads, rows, K), best first
            keep = torch.arange(top.shape[-1], device=device) < (rows[:, None] + 1).clamp(max=budget)
            rowmask = torch.zeros(b, hk, len(rows), n, dtype=torch.bool, device=device)
            rowmask.scatter_(-1, top, keep.expand_as(top))
            m[:, :, rows] = rowmask
        out.append(m)
    return out


# --- acceptance length from teacher-forced positions ------------------------------------------------------------------
def rounds_al(per_position, k: int, temperature: float) -> float:
    """AL (tokens per round = accepted drafts + 1) along a continuation of L drafted positions, drafting ``k`` a round.

    Temperature 0: ``per_position`` is the 0/1 top-1 agreement; the rounds are simulated exactly (a round from s
    accepts the run of agreements from s, capped at k, then the target adds one token; the next round starts after
    it; the last round covers what is left) and AL = L / rounds. Exact given that the drafter's predictions depend
    only on the true prefix, which holds: a round's drafts up to its first miss *are* the true prefix.

    Temperature 1: ``per_position`` is the acceptance probability a_t. A round from s accepts n < k drafts with
    probability prod_{i<n} a_{s+i} (1 - a_{s+n}), all k with prod_{i<k} a_{s+i}, and the next starts at s + n + 1;
    the expected number of rounds R(0) follows by dynamic programming (R(s >= L) = 0) and AL = L / R(0). An estimate:
    the continuation is the target's greedy one, not a sampled one, the a_t (on the target's top-k) are lower bounds,
    and L / E[rounds] is a ratio of expectations."""
    a = [float(x) for x in (per_position.tolist() if torch.is_tensor(per_position) else per_position)]
    n_pos = len(a)
    if k < 1:
        raise ValueError(f"draft length k must be >= 1, got {k}")
    if n_pos == 0:
        return 0.0
    if temperature == 0:
        rounds, s = 0, 0
        while s < n_pos:
            run = 0
            while run < k and s + run < n_pos and a[s + run] >= 0.5:
                run += 1
            rounds, s = rounds + 1, s + run + 1
        return n_pos / rounds
    if temperature != 1:
        raise ValueError(f"rounds_al models temperature 0 or 1, got {temperature}")
    a += [0.0] * (k + 1)  # beyond the end: the round is the last one either way (R = 0 there)
    expected = [0.0] * (n_pos + k + 2)
    for s in range(n_pos - 1, -1, -1):
        r, prefix = 1.0, 1.0
        for n in range(k):
            r += prefix * (1 - a[s + n]) * expected[s + n + 1]
            prefix *= a[s + n]
        expected[s] = r + prefix * expected[s + k + 1]
    return n_pos / expected[0]


# --- the study -------------------------------------------------------------------------------------------------------
def t_quantile(df: int) -> float:
    """Student-t 0.975 quantile (a 95% two-sided interval)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_interval(values) -> tuple[float, float | None, float | None]:
    """(mean, low, high): the mean over prompts and its 95% Student-t interval (None, None with one prompt)."""
    v = [float(x) for x in values]
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, None, None
    half = t_quantile(len(v) - 1) * math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v))
    return m, m - half, m + half


def prompt_stats(logits: torch.Tensor, sample: dict, k: int) -> dict:
    """One prompt's numbers over the drafted positions 1..C-1: mean acceptance, top-1, AL at T=1 and at T=0."""
    a, t = position_acceptance(logits.float().cpu(), sample["topk_ids"], sample["topk_logprobs"])
    a, t = a[1:], t[1:]
    return {"accept": float(a.mean()), "top1": float(t.mean()), "al_t1": rounds_al(a, k, 1),
            "al_t0": rounds_al(t, k, 0)}


def setting_masks(scorer, ids: torch.Tensor, prompt_len: int, fraction: float, period: int | None, capture) -> dict:
    """The masks of each compressed setting at one budget fraction, all from one dense capture of ``scorer``."""
    n = ids.shape[1]
    layout = sample_layout(prompt_len, (fraction,), random.Random(0))
    out = {"rift-stat": build_masks(n, prompt_len, selections(capture, prompt_len, n, layout), layout.tail_keep,
                                    ids.device)}
    if period:
        out["rift-dyn"] = build_masks(n, prompt_len, selections(capture, prompt_len, n, layout, period),
                                      layout.tail_keep, ids.device)
    # The same size as a RIFT row: the budget's cached keys plus the token itself.
    out["hindsight"] = hindsight_masks(scorer, ids, prompt_len, layout.budget + 1, capture=capture)
    return out


@torch.no_grad()
def gap_rows(drafter, samples: list[dict], budgets, period: int | None, k: int, scorer_model=None,
             progress: bool = True) -> list[dict]:
    """Per setting (full cache; per budget fraction rift-stat, rift-dyn when ``period``, hindsight): the mean over
    prompts of each prompt's acceptance, top-1, AL at T=1 and T=0 (:func:`prompt_stats`) with 95% intervals over
    prompts and the per-prompt values (``per_prompt``, for paired gaps: :func:`gaps`). Masks come from
    ``scorer_model`` (default ``drafter``: the self-drafter's own dense pass), logits from ``drafter``."""
    from rift_ada.attention import use_rift_attention

    scorer = drafter if scorer_model is None else scorer_model
    use_rift_attention(drafter)
    keys = [("full", None)] + [(s, b) for b in budgets for s in SETTINGS[1:] if s != "rift-dyn" or period]
    per = {key: [] for key in keys}
    kept = {b: [] for b in budgets}
    device = next(drafter.parameters()).device
    for s in tqdm(samples, desc="prompts", disable=not progress):
        ids = torch.cat([s["prompt_ids"], s["continuation_ids"]])[None].to(device)
        p = len(s["prompt_ids"])
        per["full", None].append(prompt_stats(continuation_logits(drafter, ids, None, p), s, k))
        capture = dense_capture(scorer, ids)
        for b in budgets:
            masks = setting_masks(scorer, ids, p, b, period, capture)
            kept[b].append(sample_layout(p, (b,), random.Random(0)).budget + 1)
            for setting, m in masks.items():
                per[setting, b].append(prompt_stats(continuation_logits(drafter, ids, m, p), s, k))
            del masks
        del capture
    rows = []
    for setting, b in keys:
        row = {"setting": setting, "budget_fraction": b, "period": period if setting == "rift-dyn" else None,
               "keys_per_row": None if b is None else sum(kept[b]) / len(kept[b]), "prompts": len(samples)}
        for stat in STATS:
            row[stat], row[f"{stat}_lo"], row[f"{stat}_hi"] = mean_interval([x[stat] for x in per[setting, b]])
        row["per_prompt"] = {stat: [x[stat] for x in per[setting, b]] for stat in STATS}
        rows.append(row)
    return rows


def gaps(rows: list[dict]) -> list[dict]:
    """Per budget fraction and temperature: the reading gap AL(full) - AL(hindsight) (and as a share of AL(full)) and
    the selection gaps AL(hindsight) - AL(rift-stat / rift-dyn), each a mean over prompts of the paired per-prompt
    differences with its 95% interval."""
    by = {(r["setting"], r["budget_fraction"]): r for r in rows}
    full = by["full", None]["per_prompt"]
    out = []
    for b in sorted({r["budget_fraction"] for r in rows if r["budget_fraction"] is not None}):
        for temp in ("t1", "t0"):
            stat = f"al_{temp}"
            hind = by["hindsight", b]["per_prompt"][stat]
            row = {"budget_fraction": b, "temperature": int(temp[1])}
            pairs = [("reading_gap", full[stat], hind)] + [
                (f"selection_gap_{s.split('-')[1]}", hind, by[s, b]["per_prompt"][stat])
                for s in ("rift-stat", "rift-dyn") if (s, b) in by]
            for name, hi, lo in pairs:
                row[name], row[f"{name}_lo"], row[f"{name}_hi"] = mean_interval([x - y for x, y in zip(hi, lo)])
            row["reading_share"] = row["reading_gap"] / (sum(full[stat]) / len(full[stat]))
            out.append(row)
    return out


def adapter_changes(base: list[dict], adapted: list[dict], seed: int = 0) -> list[dict]:
    """The adapter's effect, per setting, budget and temperature: AL of the untrained and the adapted drafter (the
    same masks: :func:`gap_rows` with ``scorer_model`` the base) and the relative change with its 95% interval
    (the prompts resampled in pairs: ``compressibility_eval.change_interval``); on the hindsight rows also the share
    of the untrained reading gap (full - hindsight) the adapter recovers, ``recovered`` (None without a gap)."""
    from .compressibility_eval import change_interval

    by = {(r["setting"], r["budget_fraction"]): r for r in base}
    out = []
    for r in adapted:
        b = by[r["setting"], r["budget_fraction"]]
        for temp in ("t1", "t0"):
            before, after = b["per_prompt"][f"al_{temp}"], r["per_prompt"][f"al_{temp}"]
            m0, m1 = sum(before) / len(before), sum(after) / len(after)
            low, high = change_interval(before, after, seed)
            row = {"setting": r["setting"], "budget_fraction": r["budget_fraction"], "temperature": int(temp[1]),
                   "al_untrained": m0, "al_trained": m1, "relative_change": m1 / m0 - 1, "change_low": low,
                   "change_high": high, "recovered": None}
            if r["setting"] == "hindsight":
                full = by["full", None]["per_prompt"][f"al_{temp}"]
                gap = sum(full) / len(full) - m0
                row["reading_gap"] = gap
                row["recovered"] = (m1 - m0) / gap if gap > 0 else None
            out.append(row)
    return out
