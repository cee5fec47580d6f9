"""What the draft's cache keeps: one frozen description, given to the cache once (and to the trainer's masks).

| kind      | after prefill                                   | while decoding                               |
|-----------|-------------------------------------------------|----------------------------------------------|
| `full`    | everything                                      | everything                                   |
| `window`  | `sinks` first tokens + last `budget - sinks`    | the window slides                            |
| `snapkv`  | best `budget - W` prompt tokens + last W        | generated tokens appended, nothing evicted   |
| `rift`    | best `importance` prompt tokens + last `window` | the window slides; the selection stays until a refresh rescores the whole history |

Budgets are integers (tokens): ``importance + window == budget`` for ``rift``, the window set by ``window_fraction``
(default half) or explicitly. W is the scorer's observation window. *When* to refresh is not part of a layout: that
is a controller's decision (``rift_ada.refresh``).

``refresh_grid`` (default 1) aligns what a refresh scores: with G > 1 a refresh rescores the history as it stood at the
last multiple of G generated positions (the observation queries and candidates of that moment; the window stays the
current one), so a refresh's selection is a function of (refresh time on a grid of G, history) alone. That is what
replay tables (``rift_ada.replay``) store one row per grid point for; G = 1 scores everything up to now.

While decoding, every draft query at position i sees the importance part plus the window band [i - window, i]
exactly (tokens that slid out are masked until the round's end evicts them), whatever round it is drafted in.

``lookahead`` (default 64) extends SnapKV scores forward: while a model copies or quotes, the keys it needs next lie
just after those its recent queries attended, beyond the reach of SnapKV's symmetric pooling. On the first testbed's
copy tasks, refreshing every 32 tokens kept 13% of the full cache's AL with plain SnapKV scores and 100% with
``lookahead=64``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .scorers import SCORERS, is_scorer_file, make_scorer

KINDS = ("full", "window", "snapkv", "rift")
MAX_REFRESH_GRID = 64  # the observation queries of a grid point must still be in the cache's query buffer


@dataclass(frozen=True)
class CacheLayout:
    kind: str = "rift"
    budget: int | None = None
    window_fraction: float = 0.5
    window: int | None = None  # rift: the sliding window in tokens (overrides window_fraction)
    sinks: int = 4  # window: first tokens always kept
    scorer: str = "snapkv"  # a registered scorer's name, or a learned scorer's file (scorers/learned.py)
    obs_window: int = 32
    lookahead: int = 64  # snapkv scores extended this far forward (0 = plain SnapKV); see scorers/base.py
    scorer_options: tuple = ()  # e.g. (("kernel", 7), ("pooling", "max")) for snapkv
    store: bool = True  # keep a backing store of the full history, so a refresh can rescore it
    refresh_grid: int = 1  # a refresh scores the history as of the last multiple of this many generated positions
    _window: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown cache layout {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.scorer not in SCORERS and not is_scorer_file(self.scorer):
            raise ValueError(f"unknown scorer {self.scorer!r}; choose one of {', '.join(SCORERS)}, or a learned "
                             "scorer's file (*.pt)")
        if self.obs_window < 1:
            raise ValueError(f"observation window must be >= 1, got {self.obs_window}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if (not isinstance(self.refresh_grid, int) or isinstance(self.refresh_grid, bool)
                or not 1 <= self.refresh_grid <= MAX_REFRESH_GRID):
            raise ValueError(f"refresh grid must be an integer in [1, {MAX_REFRESH_GRID}] (generated tokens), got "
                             f"{self.refresh_grid!r}")
        object.__setattr__(self, "scorer_options", tuple(sorted(dict(self.scorer_options).items())))
        self.make_scorer()  # an option the scorer does not take fails here, when the layout is described
        if self.kind == "full":
            return
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 1:
            raise ValueError(f"a {self.kind!r} cache needs a budget: a positive integer number of tokens, got "
                             f"{self.budget!r}")
        if self.kind == "window" and self.budget <= self.sinks:
            raise ValueError(f"budget ({self.budget}) must exceed the {self.sinks} attention sinks")
        if self.kind == "snapkv" and self.budget < self.obs_window:
            raise ValueError(f"budget ({self.budget}) is smaller than the observation window ({self.obs_window})")
        if self.kind == "rift":
            window = self.window
            if window is None:
                if not 0.0 < self.window_fraction <= 1.0:
                    raise ValueError(f"window fraction must be in (0, 1], got {self.window_fraction}")
                window = max(1, round(self.budget * self.window_fraction))
            if not 1 <= window <= self.budget:
                raise ValueError(f"the sliding window ({window}) must be between 1 and the budget ({self.budget})")
            object.__setattr__(self, "_window", window)

    # --- the split, in tokens ------------------------------------------------------------------------------------
    @property
    def compress(self) -> bool:
        """Whether prefill is followed by a selection (everything but ``full``)."""
        return self.kind != "full"

    @property
    def n_imp(self) -> int:
        """Importance entries per KV head."""
        return {"full": 0, "window": self.sinks, "snapkv": (self.budget or 0) - self.obs_window,
                "rift": (self.budget or 0) - self._window}[self.kind]

    @property
    def tail_keep(self) -> int:
        """Most recent tokens kept at compression (the sliding window)."""
        return {"full": 0, "window": (self.budget or 0) - self.sinks, "snapkv": self.obs_window,
                "rift": self._window}[self.kind]

    @property
    def tail_limit(self) -> int | None:
        """The tail is evicted down to this after each round (None: never evicted)."""
        return self.tail_keep if self.kind in ("window", "rift") else None

    @property
    def refreshable(self) -> bool:
        return self.kind == "rift" and self.store

    def make_scorer(self):
        if self.kind == "window":
            return make_scorer("streaming")
        opts = dict(self.scorer_options)
        if self.scorer == "snapkv":
            opts.setdefault("lookahead", self.lookahead)
        return make_scorer(self.scorer, **opts)

    def describe(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "rift":
            grid = f", refresh grid {self.refresh_grid}" if self.refresh_grid > 1 else ""
            return f"rift (budget {self.budget}: {self.n_imp} importance + {self.tail_keep} window{grid})"
        return f"{self.kind} (budget {self.budget})"


def covering_lookahead(period: int, refresh_grid: int = 1, draft_length: int = 11) -> int:
    """The smallest power of two of tokens a periodic refresh's selection must reach past what its queries attended,
    so that a copy never outruns it before the next refresh: the scoring point lies up to ``refresh_grid - 1``
    tokens before the refresh, the next refresh comes ``period`` tokens after it, and the round that crosses it
    drafts up to ``draft_length`` more. With less, a copying draft falls off its selection each period and
    rejects once per token until the refresh (docs/paper-regime.md: 73% of the AL lost at 32K with 64 where this
    gives 256)."""
    for name, v in (("period", period), ("refresh grid", refresh_grid), ("draft length", draft_length)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return 1 << (refresh_grid - 1 + period + draft_length - 1).bit_length()
