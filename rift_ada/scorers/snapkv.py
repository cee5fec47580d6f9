"""SnapKV: attention that a window of recent queries pays to each key, pooled along tokens.

Defaults follow the SnapKV paper's LongBench runs (observation window 32, max-pooling with kernel 7). kvpress uses
window 64 with avg-pooling of kernel 5 (with zero padding); ``SnapKVScorer(window=64, kernel=5, pooling="avg")`` is
that configuration without the padding artefact.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import extend_forward, pool_scores, window_attention


@dataclass
class SnapKVScorer:
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    lookahead: int = 0  # extend scores this many tokens forward (see base.extend_forward); 0 = plain SnapKV
    name: str = "snapkv"
    needs_queries: bool = True

    def __post_init__(self):
        if self.window < 1 or self.kernel < 1 or self.lookahead < 0:
            raise ValueError("SnapKV window and kernel must be >= 1 and lookahead >= 0")
        if self.pooling not in ("max", "avg", "none"):
            raise ValueError(f"pooling must be 'max', 'avg' or 'none', got {self.pooling!r}")

    def score(self, queries, keys, query_positions, key_positions):
        q, qp = queries[:, :, -self.window:], query_positions[-self.window:]
        pooled = pool_scores(window_attention(q, keys, qp, key_positions), self.kernel, self.pooling)
        return extend_forward(pooled, self.lookahead)
