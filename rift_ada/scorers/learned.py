"""A learned scorer: what the observation queries attend to, spread over the keys after it by learned weights.

SnapKV keeps the keys the last W queries attended; ``lookahead`` extends each score a fixed distance forward, because
while a model copies, the keys it needs next lie *after* those it attends now. How far, and how much the newest
queries (where the copy is now) should count against the older ones, depend on the model and the task: this scorer
learns them. Per KV head it computes, from the same queries and keys SnapKV reads, three attention profiles over the
keys (the mean over all W observation queries, over the newest ``recent`` of them, and the maximum over them), each
scaled so that uniform attention reads 1; for each, the attention summed over the ``spans`` keys up to and including
a key (the mass it would inherit from the copy position behind it) and over the few keys after it; then a small MLP,
shared by every layer and head, maps those features to the key's score. Everything is a cumulative sum and a
per-key MLP: linear in the history, a few milliseconds at 8K tokens.

It is trained (``experiments/train_scorer.py``, ``rift_ada.trainers.scorer``) so that its ranking matches where
a dense pass of the same draft over the continuation attends: the keys later queries read are the ones to keep. The
file it writes is what ``--scorer PATH`` (and ``CacheLayout(scorer=PATH)``) loads.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn


FORMAT = "rift-ada-learned-scorer/1"
SPANS = (1, 4, 16, 48, 96, 160, 256)  # keys up to and including each key (the mass behind it)
AHEAD = (2, 8)  # keys after each key (the neighbours SnapKV's pooling keeps)
RECENT = 4  # the newest observation queries: where the copy is now


def profiles(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
             key_positions: torch.Tensor, recent: int = RECENT) -> torch.Tensor:
    """(batch, kv_heads, 3, tokens): the attention of the observation queries (each query's averaged over its KV
    group, causal by position): their mean (SnapKV's score), the mean of the newest ``recent``, and the maximum over
    single queries; x tokens, so uniform attention reads 1."""
    b, hq, w, d = queries.shape
    hkv, t = keys.shape[1], keys.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot be grouped over {hkv} KV heads")
    q = queries.float().reshape(b, hkv, (hq // hkv) * w, d)  # no repeat of the keys over the group
    logits = (q @ keys.float().transpose(-1, -2)) / math.sqrt(d)
    future = key_positions.to(logits.device)[None, :] > query_positions.to(logits.device)[:, None]  # (w, t)
    p = logits.view(b, hkv, hq // hkv, w, t).masked_fill(future, float("-inf")).softmax(-1).mean(2)
    return torch.stack([p.mean(2), p[:, :, -recent:].mean(2), p.amax(2)], 2) * t


def features(profile: torch.Tensor, spans=SPANS, ahead=AHEAD) -> torch.Tensor:
    """(batch, kv_heads, tokens, F) from :func:`profiles`: log1p of each profile, of its mean over the ``spans``
    keys up to each key and over the ``ahead`` keys after it."""
    b, h, c, t = profile.shape
    zero = profile.new_zeros(b, h, c, 1)
    csum = torch.cat([zero, profile.cumsum(-1)], -1)  # csum[..., j] = sum of the first j keys
    idx = torch.arange(t, device=profile.device)
    out = [profile]
    for s in spans[1:] if spans and spans[0] == 1 else spans:
        lo = (idx + 1 - s).clamp(min=0)
        out.append((csum[..., idx + 1] - csum[..., lo]) / s)
    for a in ahead:
        hi = (idx + 1 + a).clamp(max=t)
        out.append((csum[..., hi] - csum[..., idx + 1]) / a)
    return torch.log1p(torch.cat(out, 2)).transpose(2, 3)


def n_features(spans=SPANS, ahead=AHEAD) -> int:
    return 3 * (1 + len([s for s in spans if s != 1]) + len(ahead))


def make_net(n_in: int, hidden: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, 1))


@dataclass
class LearnedScorer:
    """``score`` as every scorer (``(batch, kv_heads, tokens)``, higher = keep) from a trained network ``net`` over
    :func:`features`. Built from a file with :meth:`load` (what ``make_scorer(path)`` does)."""

    net: nn.Module
    spans: tuple = SPANS
    ahead: tuple = AHEAD
    recent: int = RECENT
    meta: dict = field(default_factory=dict)  # how it was trained (the file's record)
    name: str = "learned"
    needs_queries: bool = True

    @torch.no_grad()
    def score(self, queries, keys, query_positions, key_positions):
        x = features(profiles(queries, keys, query_positions, key_positions, self.recent), self.spans, self.ahead)
        return self.net(x.float()).squeeze(-1)

    def save(self, path: str | Path) -> None:
        torch.save({"format": FORMAT, "state": self.net.state_dict(), "hidden": self.net[0].out_features,
                    "spans": list(self.spans), "ahead": list(self.ahead), "recent": self.recent, "meta": self.meta},
                   path)

    @classmethod
    def load(cls, path: str | Path) -> "LearnedScorer":
        path = Path(path)
        return _load(str(path.resolve()), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: int) -> LearnedScorer:
    """One network per file version: every layer and every cache of a run share it."""
    from ..files import read_torch

    d = read_torch(path, "a learned scorer file")
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{path}: not a learned scorer file (experiments/train_scorer.py writes them)")
    spans, ahead = tuple(d["spans"]), tuple(d["ahead"])
    net = make_net(n_features(spans, ahead), int(d["hidden"]))
    net.load_state_dict(d["state"])
    return LearnedScorer(net.eval(), spans, ahead, int(d["recent"]), dict(d.get("meta") or {}))


def is_scorer_file(name) -> bool:
    """Whether ``name`` names a file (a learned scorer's) rather than a registered scorer."""
    return isinstance(name, (str, os.PathLike)) and Path(name).suffix == ".pt"
