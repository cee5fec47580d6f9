"""Per-head selection: which positions the importance part keeps (the split itself is ``rift_ada.layout``)."""

from __future__ import annotations

import torch


def top_positions(scores: torch.Tensor, candidates: torch.Tensor, n: int, count: int | None = None) -> torch.Tensor:
    """The ``n`` best candidate positions per KV head, sorted ascending.

    ``scores``: (batch, kv_heads, T) for positions ``0..T-1``; ``candidates``: (T,) bool, ``count`` of them True if
    the caller knows (else read back from the device). Returns (batch, kv_heads, min(n, #candidates)) long: every head
    keeps the same count, so layers stay rectangular.
    """
    n = min(n, int(candidates.sum()) if count is None else count)
    b, h, _ = scores.shape
    if n <= 0:
        return torch.empty(b, h, 0, dtype=torch.long, device=scores.device)
    masked = scores.float().masked_fill(~candidates.to(scores.device), float("-inf"))
    return masked.topk(n, dim=-1).indices.sort(dim=-1).values


def gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x``: (batch, kv_heads, T, d); ``positions``: (batch, kv_heads, n) -> (batch, kv_heads, n, d)."""
    idx = positions.to(x.device).unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])
    return x.gather(2, idx)


def observation_window(queries: torch.Tensor | None, positions: torch.Tensor | None, w: int):
    """The last ``w`` recorded queries (b, q_heads, w, d) and their positions: the one place the window is cut."""
    if queries is None or queries.shape[2] == 0:
        return None, None
    return queries[:, :, -w:], positions[-w:]


def select_importance(scorer, keys: torch.Tensor, length: int, n_imp: int, tail_keep: int,
                      queries: torch.Tensor | None = None, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """The importance positions (batch, kv_heads, n) that a cache holding ``length`` tokens keeps per KV head: the
    scorer's best ``n_imp`` among positions before the last ``tail_keep`` (which the sliding window holds).

    ``keys``: (batch, kv_heads, >= length, d) post-RoPE keys of the history; ``queries``: the observation window
    (``observation_window``). The decoder's cache and the compressibility trainer's masks both select through this
    one function.
    """
    keys = keys[:, :, :length]
    positions = torch.arange(length, device=keys.device)
    if scorer.needs_queries:
        if queries is None:
            raise RuntimeError("no observation queries were recorded: the draft must run with rift attention "
                               "(rift_ada.attention.use_rift_attention) and rift_observer=<cache>")
        q, qp = queries.to(keys.device), query_positions.to(keys.device)
    else:
        q = qp = None
    scores = scorer.score(q, keys, qp, positions)
    end = length - min(tail_keep, length)
    return top_positions(scores, positions < end, n_imp, count=end)
