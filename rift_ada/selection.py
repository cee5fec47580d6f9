"""Budgets and per-head selection: how many tokens go to importance vs the sliding window, and which ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Budget:
    """An integer token budget for the draft's active cache: ``importance + window == total``."""

    total: int
    window: int

    @property
    def importance(self) -> int:
        return self.total - self.window

    @classmethod
    def split(cls, total: int, window_fraction: float = 0.5, window: int | None = None) -> "Budget":
        if not isinstance(total, int) or total < 1:
            raise ValueError(f"budget must be a positive integer number of tokens, got {total!r}")
        if window is None:
            if not 0.0 < window_fraction <= 1.0:
                raise ValueError(f"window fraction must be in (0, 1], got {window_fraction}")
            window = max(1, round(total * window_fraction))
        if not 1 <= window <= total:
            raise ValueError(f"the sliding window ({window}) must be between 1 and the budget ({total})")
        return cls(total, window)


def top_positions(scores: torch.Tensor, candidates: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` best candidate positions per KV head, sorted ascending.

    ``scores``: (batch, kv_heads, T) for positions ``0..T-1``; ``candidates``: (T,) bool. Returns (batch, kv_heads,
    min(n, #candidates)) long: every head keeps the same count, so layers stay rectangular.
    """
    n = min(n, int(candidates.sum()))
    b, h, _ = scores.shape
    if n <= 0:
        return torch.empty(b, h, 0, dtype=torch.long, device=scores.device)
    masked = scores.float().masked_fill(~candidates.to(scores.device), float("-inf"))
    return masked.topk(n, dim=-1).indices.sort(dim=-1).values


def gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x``: (batch, kv_heads, T, d); ``positions``: (batch, kv_heads, n) -> (batch, kv_heads, n, d)."""
    idx = positions.to(x.device).unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])
    return x.gather(2, idx)


def select_importance(scorer, keys: torch.Tensor, length: int, n_imp: int, tail_keep: int,
                      queries: torch.Tensor | None = None, query_positions: torch.Tensor | None = None,
                      obs_window: int = 32) -> torch.Tensor:
    """The importance positions (batch, kv_heads, n) that a cache holding ``length`` tokens keeps per KV head: the
    scorer's best ``n_imp`` among positions before the last ``tail_keep`` (which the sliding window holds).

    ``keys``: (batch, kv_heads, >= length, d) post-RoPE keys of the history; ``queries``: the recorded observation
    queries, of which the last ``obs_window`` score. The decoder's cache and the compressibility trainer's masks
    both select through this one function.
    """
    keys = keys[:, :, :length]
    positions = torch.arange(length, device=keys.device)
    if scorer.needs_queries:
        if queries is None or queries.shape[2] == 0:
            raise RuntimeError("no observation queries were recorded: the draft must run with rift attention "
                               "(rift_ada.attention.use_rift_attention) and rift_observer=<cache>")
        q, qp = queries[:, :, -obs_window:].to(keys.device), query_positions[-obs_window:].to(keys.device)
    else:
        q = qp = None
    scores = scorer.score(q, keys, qp, positions)
    return top_positions(scores, positions < length - min(tail_keep, length), n_imp)
