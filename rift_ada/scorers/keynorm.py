"""Key-norm: keys with a *small* L2 norm tend to draw the most attention (Devoto et al., 2024), so keep those."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KeyNormScorer:
    name: str = "keynorm"
    needs_queries: bool = False

    def score(self, queries, keys, query_positions, key_positions):
        return -keys.float().norm(dim=-1)
