"""The scorer contract and the helpers scorers share.

Every scorer meets one contract::

    score(queries, keys, query_positions, key_positions) -> (batch, kv_heads, tokens)   # higher = keep

- ``queries``: (batch, q_heads, W, head_dim) post-RoPE observation queries (the last W accepted tokens), or None
  for scorers that do not use them;
- ``keys``: (batch, kv_heads, tokens, head_dim) post-RoPE keys of the candidate history;
- positions: absolute token positions (1-D long tensors), used for causality and position-based scores.
Scores are per KV head, so grouped-query attention selects per KV head and memory really shrinks.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class Scorer(Protocol):
    name: str
    needs_queries: bool

    def score(self, queries: torch.Tensor | None, keys: torch.Tensor, query_positions: torch.Tensor | None,
              key_positions: torch.Tensor) -> torch.Tensor: ...


def window_attention(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                     key_positions: torch.Tensor) -> torch.Tensor:
    """Mean attention each key receives from the observation queries, averaged within each KV group.

    Softmax over all keys in fp32, with causality from absolute positions (a query never sees a later key).
    Returns (batch, kv_heads, tokens).
    """
    b, hq, w, d = queries.shape
    hkv, t = keys.shape[1], keys.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot be grouped over {hkv} KV heads")
    g = hq // hkv
    # (b, hkv, g*w, d) @ (b, hkv, d, t): no repeat of the keys over the group.
    q = queries.float().reshape(b, hkv, g * w, d)
    logits = (q @ keys.float().transpose(-1, -2)) / math.sqrt(d)
    future = key_positions.to(logits.device)[None, :] > query_positions.to(logits.device)[:, None]  # (w, t)
    logits = logits.view(b, hkv, g, w, t).masked_fill(future, float("-inf"))
    return logits.softmax(-1).mean(dim=(2, 3))


def pool_scores(scores: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """1-D pooling along tokens so neighbours of a strong key are kept with it (same length out)."""
    if kind == "none" or kernel <= 1:
        return scores
    b, h, t = scores.shape
    x = scores.reshape(b * h, 1, t)
    if kind == "max":
        x = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    elif kind == "avg":
        # count_include_pad=False: zero padding would deflate the scores at both ends (kvpress's default does).
        x = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    else:
        raise ValueError(f"pooling must be 'max', 'avg' or 'none', got {kind!r}")
    return x[..., :t].reshape(b, h, t)


def extend_forward(scores: torch.Tensor, radius: int, floor: float = 0.5) -> torch.Tensor:
    """Let each key inherit the (decayed) score of up to ``radius`` keys before it.

    When a model retrieves a span (copying, quoting), the query at step t attends to source position j and the
    query at t+1 to j+1: the keys a draft needs next lie just *after* those its recent queries attended. Symmetric
    pooling only reaches ``kernel // 2`` ahead. The decay (to ``floor`` at distance ``radius``) keeps the nearer
    positions first when the budget cannot hold every extended span.
    """
    if radius <= 0:
        return scores
    out = scores.clone()
    t = scores.shape[-1]
    for d in range(1, min(radius, t - 1) + 1):
        factor = 1.0 - (1.0 - floor) * d / radius
        out[..., d:] = torch.maximum(out[..., d:], scores[..., :-d] * factor)
    return out
