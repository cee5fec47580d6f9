"""StreamingLLM's attention sinks: the earliest positions score highest, so a budget of n keeps the first n tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamingScorer:
    name: str = "streaming"
    needs_queries: bool = False

    def score(self, queries, keys, query_positions, key_positions):
        b, h, t, _ = keys.shape
        return (-key_positions.to(keys.device).float()).expand(b, h, t)
