"""Draft caches that never refresh (a sliding window, SnapKV's prefill selection, RIFT-stat at any budget) over a
table's continuation, and acceptance length by generation position (the decode-staleness curve).

A cache that never refreshes shows every query at position i a fixed selection of the prompt plus a band of the most
recent tokens (``window``: the first ``sinks`` tokens and [i - (budget - sinks), i]; ``snapkv``: the prefill's
selection and everything from the prompt's last ``obs_window`` tokens on, nothing evicted; ``rift``: the prefill's
selection and [i - window, i]). One teacher-forced pass of the draft under that view, computing every generated
token itself (:class:`~rift_ada.replay.rows.RowPass` from the prompt's end), gives its acceptance at every position:
a one-row table that replays exactly (the dense-history approximation of refreshed rows does not arise).
"""

from __future__ import annotations

import numpy as np
import torch

from ..layout import CacheLayout
from .process import Replay
from .rows import Dense, RowPass, dense_pass, selections
from .table import ReplayTable, layout_dict


@torch.inference_mode()
def fixed_table(draft, base: ReplayTable, layout: CacheLayout, dense: Dense | None = None) -> ReplayTable:
    """``base``'s prompt and continuation under ``layout`` (kind window, snapkv or rift) that never refreshes: a
    one-row table (``draft`` must be the draft ``base`` was built with for its signals to mean the same)."""
    if layout.kind not in ("window", "snapkv", "rift"):
        raise ValueError(f"a fixed-cache row needs a window, snapkv or rift layout, not {layout.kind!r}")
    P = base.prompt_len
    if P <= layout.budget:
        raise ValueError(f"the prompt ({P} tokens) fits the budget ({layout.budget}): nothing to compress")
    ids = torch.tensor([base.prompt.tolist() + base.tokens.tolist()], device=draft.device)
    dense = dense_pass(draft, ids) if dense is None else dense
    h = base.header
    rows = RowPass(draft, ids, P, layout, dense, h["temperature"], h["top_k"], h["top_p"])
    vals = rows.run([P], selections(dense, [P], layout))
    # one row: its grid spans the continuation (a refresh would have nothing to rescore to)
    header = {**h, "layout": layout_dict(layout), "grid": max(len(base.tokens) - 1, 1), "build_seconds": {}}
    return ReplayTable(header, base.prompt, base.tokens, base.p, vals.q, vals.entropy, vals.focus, vals.runway,
                       vals.drift, base.full_q, base.full_entropy)


def al_by_position(runs: list[Replay], width: int, tokens: int) -> np.ndarray:
    """Acceptance length of the rounds that start in each ``width``-token bin of the generation (NaN where none
    does), pooled over ``runs`` (the replays of one table)."""
    bins = -(-tokens // width)
    total, count = np.zeros(bins), np.zeros(bins)
    for run in runs:
        for r in run.rounds:
            b = min(r.position // width, bins - 1)
            total[b] += r.accepted + 1
            count[b] += 1
    with np.errstate(invalid="ignore"):
        return total / count
