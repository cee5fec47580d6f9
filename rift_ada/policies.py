"""Cache policies: what the draft's cache keeps, and when it rescores.

| policy      | after prefill                                   | during decoding                        | refresh            |
|-------------|-------------------------------------------------|----------------------------------------|--------------------|
| `full`      | everything                                      | everything                             | -                  |
| `window`    | `sinks` first tokens + last `budget - sinks`    | window slides                          | -                  |
| `snapkv`    | best `budget - W` prompt tokens + last W        | generated tokens appended, nothing evicted | -              |
| `rift-stat` | best `importance` prompt tokens + last `window` | window slides, selection stays         | never (by itself)  |
| `rift-dyn`  | as rift-stat                                    | as rift-stat                           | every `period` generated tokens |
| `rift-ada`  | as rift-stat                                    | as rift-stat                           | when a controller says |

Budgets are integers (tokens): ``importance + window == budget``, the split set by ``window_fraction`` (default half)
or an explicit ``window``. W is the scorer's observation window.

``lookahead`` (default 64) extends SnapKV scores forward: while a model copies or quotes, the keys it needs next lie
just after those its recent queries attended, beyond the reach of SnapKV's symmetric pooling. On the testbed's copy
tasks, RIFT-dyn refreshing every 32 tokens keeps 13% of the full cache's AL with plain SnapKV scores and 100% with
``lookahead=64`` (``experiments/policy_table.py --lookahead 0`` reproduces the first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .scorers import SCORERS, make_scorer
from .selection import Budget

POLICIES = ("full", "window", "snapkv", "rift-stat", "rift-dyn", "rift-ada")


class Layout(NamedTuple):
    compress: bool  # select after prefill
    n_imp: int  # importance entries per KV head
    tail_keep: int  # tail kept at compression
    tail_limit: int | None  # tail evicted down to this after each round (None: never evict)


@dataclass
class CachePolicy:
    name: str = "rift-stat"
    budget: int | None = None
    window_fraction: float = 0.5
    window: int | None = None
    sinks: int = 4
    period: int | None = None
    scorer: str = "snapkv"
    obs_window: int = 32
    lookahead: int = 64  # snapkv scores extended this far forward (0 = plain SnapKV); see scorers/base.py
    scorer_options: dict = field(default_factory=dict)  # e.g. {"kernel": 7, "pooling": "max"} for snapkv

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose one of {', '.join(POLICIES)}")
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown scorer {self.scorer!r}; choose one of {', '.join(SCORERS)}")
        if self.obs_window < 1:
            raise ValueError(f"observation window must be >= 1, got {self.obs_window}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.name == "full":
            return
        if self.budget is None:
            raise ValueError(f"policy {self.name!r} needs a budget (tokens)")
        if not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"budget must be a positive integer number of tokens, got {self.budget!r}")
        if self.name == "window" and self.budget <= self.sinks:
            raise ValueError(f"budget ({self.budget}) must exceed the {self.sinks} attention sinks")
        if self.name == "snapkv" and self.budget < self.obs_window:
            raise ValueError(f"budget ({self.budget}) is smaller than the observation window ({self.obs_window})")
        if self.name.startswith("rift"):
            Budget.split(self.budget, self.window_fraction, self.window)  # validates the split
        if self.name == "rift-dyn":
            if self.period is None or self.period < 1:
                raise ValueError(f"rift-dyn needs --period >= 1 (generated tokens between refreshes), got {self.period}")

    @property
    def keeps_store(self) -> bool:
        return self.name in ("rift-dyn", "rift-ada")

    @property
    def split(self) -> Budget:
        return Budget.split(self.budget, self.window_fraction, self.window)

    def layout(self) -> Layout:
        if self.name == "full":
            return Layout(False, 0, 0, None)
        if self.name == "window":
            return Layout(True, self.sinks, self.budget - self.sinks, self.budget - self.sinks)
        if self.name == "snapkv":
            return Layout(True, self.budget - self.obs_window, self.obs_window, None)
        b = self.split
        return Layout(True, b.importance, b.window, b.window)

    def make_scorer(self):
        if self.name == "window":
            return make_scorer("streaming")
        opts = dict(self.scorer_options)
        if self.scorer == "snapkv":
            opts.setdefault("window", self.obs_window)
            opts.setdefault("lookahead", self.lookahead)
        return make_scorer(self.scorer, **opts)

    def wants_refresh(self, tokens_since_refresh: int) -> bool:
        """The policy's own schedule (rift-dyn); a controller overrides it for rift-ada."""
        return self.name == "rift-dyn" and tokens_since_refresh >= self.period
