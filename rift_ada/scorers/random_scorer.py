"""Uniform random scores: the floor every informed scorer should beat. Seeded, so runs repeat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RandomScorer:
    seed: int = 0
    name: str = "random"
    needs_queries: bool = False
    _gen: torch.Generator = field(init=False, repr=False)

    def __post_init__(self):
        self._gen = torch.Generator().manual_seed(self.seed)

    def score(self, queries, keys, query_positions, key_positions):
        b, h, t, _ = keys.shape
        return torch.rand(b, h, t, generator=self._gen).to(keys.device)
