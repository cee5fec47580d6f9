"""SnapKV: attention that a window of recent queries pays to each key, pooled along tokens.

Defaults follow the SnapKV paper's LongBench runs (max-pooling with kernel 7; the observation window, 32 there, is
the cache layout's ``obs_window``: the scorer gets exactly the queries it scores with). kvpress uses window 64 with
avg-pooling of kernel 5 (with zero padding); ``obs_window=64`` with ``SnapKVScorer(kernel=5, pooling="avg")`` is that
configuration without the padding artefact.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import extend_forward, pool_scores, window_attention


@dataclass
class SnapKVScorer:
    kernel: int = 7
    pooling: str = "max"
    lookahead: int = 0  # extend scores this many tokens forward (see base.extend_forward); 0 = plain SnapKV
    name: str = "snapkv"
    needs_queries: bool = True

    def __post_init__(self):
        if self.kernel < 1 or self.lookahead < 0:
            raise ValueError("SnapKV kernel must be >= 1 and lookahead >= 0")
        if self.pooling not in ("max", "avg", "none"):
            raise ValueError(f"pooling must be 'max', 'avg' or 'none', got {self.pooling!r}")

    def score(self, queries, keys, query_positions, key_positions):
        pooled = pool_scores(window_attention(queries, keys, query_positions, key_positions), self.kernel,
                             self.pooling)
        return extend_forward(pooled, self.lookahead)
