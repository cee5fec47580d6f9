"""TOVA: keep the keys the most recent query attends to (a window of one query, no pooling)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import window_attention


@dataclass
class TOVAScorer:
    name: str = "tova"
    needs_queries: bool = True

    def score(self, queries, keys, query_positions, key_positions):
        return window_attention(queries[:, :, -1:], keys, query_positions[-1:], key_positions)
