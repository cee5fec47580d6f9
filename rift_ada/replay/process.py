"""The decoder's rounds as arithmetic over a replay table.

A round that starts with ``g`` tokens generated drafts ``k = min(draft_length, max_new_tokens - g - 1)`` tokens,
the draft's predictions of continuation tokens g .. g + k - 1 under the row in force (the last refresh's). Greedy,
it accepts the leading run of tokens whose argmax is the emitted one; sampling, each drafted token u is kept with
probability a_u = min(1, q(x_u) / p(x_u)), independently, until the first rejection (docs/replay.md: given the
emitted text this is the exact rejection rule's acceptance process). It emits accepted + 1 tokens. Between rounds
the draft's cache holds every token but the pending one (two after a round that accepted all k), so a refresh before
the round scores the history of length ``prompt + g - pending``: row ``(g - pending) // grid``.

:class:`Replay` steps one episode as ``SpeculativeDecoder.step`` would (its records carry the same counts, and
:meth:`Replay.state` is the ``DecoderState`` the decoder would publish, so ``rift_ada.signals.observe`` gives a
controller the same observation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..signals import FRESH, DecoderState, recent_after, since_refresh_after, target_p_mean
from .table import ReplayTable


@dataclass
class ReplayRound:
    """What a round gives, as ``RoundRecord`` names it (the fields a metric or a reward reads)."""

    position: int
    accepted: int
    emitted: int
    draft_length: int
    refreshed: bool
    row: int  # the table row in force during the round


class Replay:
    """One prompt's decode over ``table`` with ``draft_length`` (k). ``reset(rng)`` starts it; ``step(refresh)`` runs
    a round; ``state`` is what the decoder would publish after it. Sampling tables draw acceptances from ``rng``."""

    def __init__(self, table: ReplayTable, draft_length: int = 11):
        if not isinstance(draft_length, int) or draft_length < 1:
            raise ValueError(f"draft length k must be an integer >= 1, got {draft_length!r}")
        self.table, self.k = table, draft_length
        self.P, self.G, self.N = table.prompt_len, table.grid, int(table.tokens.shape[0])
        self.max_new = table.max_new_tokens
        # Acceptance beyond the continuation (after an EOS) counts as a rejection; one spare column for k past it.
        self.acc = np.concatenate([np.nan_to_num(table.accept(), nan=0.0),
                                   np.zeros((table.rows, draft_length + 1), np.float32)], 1).astype(np.float64)
        self.greedy = table.temperature == 0
        self.log_vocab = float(np.log(table.vocab_size))
        self.done = True

    def reset(self, rng: np.random.Generator | None = None, prompt_tokens: int | None = None) -> DecoderState:
        """Start the episode. ``prompt_tokens``: the prompt length its states report (None: the table's), for pricing
        its rounds at another context length (``rift_ada.joint``); what it accepts stays the table's."""
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.prompt_tokens = self.P if prompt_tokens is None else int(prompt_tokens)
        self.g, self.pending, self.row, self.since, self.since_draft = 1, 1, 0, 0, 0
        self.drafted = self.accepted = 0
        self.recent: tuple[float, ...] = ()  # signals.recent_after
        self.rounds: list[ReplayRound] = []
        self.last_entropy = (0.0, 0.0)
        self.fresh: list[float] = []
        self.drift_floor = float(self.table.header["initial"]["drift"])
        self.done = self.N <= 1 or self.max_new <= 1
        return self.state

    @property
    def length(self) -> int:
        """The draft cache's history length now (every token but the pending ones)."""
        return self.P + self.g - self.pending

    def step(self, refresh: bool, draft_length: int | None = None) -> ReplayRound:
        """A round, as ``SpeculativeDecoder.step(refresh, draft_length)``: ``draft_length`` this round's k in
        0 .. the replay's (None: that; 0: one plain target step)."""
        if self.done:
            raise RuntimeError("the replayed generation is finished: call reset()")
        if draft_length is not None and not (isinstance(draft_length, int) and 0 <= draft_length <= self.k):
            raise ValueError(f"a round's draft_length must be an integer in [0, {self.k}], got {draft_length!r}")
        g, refresh = self.g, bool(refresh)
        if refresh:
            self.row = (g - self.pending) // self.G
        k = min(self.k if draft_length is None else draft_length, self.max_new - g - 1)
        a = self.acc[self.row, g:g + k]
        ok = a >= 1.0 if self.greedy else self.rng.random(k) < a
        n = int(np.argmin(ok)) if not ok.all() else k
        steps = self.table.entropy[self.row, g:g + min(n + 1, k)]  # the steps up to the first rejected one
        self.last_entropy = (float(steps.mean()), float(steps.max())) if len(steps) else (0.0, 0.0)
        emitted = min(n + 1, self.N - g)
        rec = ReplayRound(g, n, emitted, k, refresh, self.row)
        self.rounds.append(rec)
        self.since = since_refresh_after(self.since, refresh, emitted)
        if refresh:
            self.fresh = []
        if len(self.fresh) < FRESH and k:
            self.fresh.append(n / k)
        self.since_draft = self.since_draft + emitted if k == 0 else 0
        self.recent = recent_after(self.recent, n, k)
        self.drafted, self.accepted = self.drafted + k, self.accepted + n
        self.g += emitted
        self.pending = self.pending + 1 if k == 0 else (2 if n == k else 1)
        self.done = self.g >= self.N
        if refresh:
            self.drift_floor = float(self.table.drift[self.row, self.length - self.P])
        return rec

    @property
    def state(self) -> DecoderState:
        """The ``DecoderState`` the decoder publishes at this point (``SpeculativeDecoder.state``)."""
        t = self.table
        if self.length == self.P:  # the draft cache holds the prompt alone (no round yet, or plain steps only)
            init = t.header["initial"]
            runway, focus, drift = init["runway"], init["focus"], init["drift"]
        else:
            u = self.length - self.P
            runway, focus, drift = (float(t.runway[self.row, u]), float(t.focus[self.row, u]),
                                    float(t.drift[self.row, u]))
        return DecoderState(
            generated=self.g, max_new_tokens=self.max_new, rounds=len(self.rounds), tokens_since_refresh=self.since,
            drift=drift, acceptance=self.recent,
            entropy_mean=self.last_entropy[0], entropy_max=self.last_entropy[1], vocab_size=t.vocab_size,
            runway=runway, focus=focus, fresh=tuple(self.fresh), drift_floor=self.drift_floor,
            prompt_tokens=self.prompt_tokens, since_draft=self.since_draft, drafted_total=self.drafted,
            accepted_total=self.accepted, target_p=target_p_mean(t.p, self.g), match=int(t.matches()[self.g]))

    @property
    def refreshes(self) -> int:
        return sum(r.refreshed for r in self.rounds)

    def acceptance_length(self) -> float:
        return float(np.mean([r.accepted + 1 for r in self.rounds])) if self.rounds else 0.0


def replay(table: ReplayTable, decide, draft_length: int = 11, rng: np.random.Generator | None = None) -> Replay:
    """Run one episode with ``decide(replay) -> bool`` choosing each round's refresh; returns the finished Replay."""
    r = Replay(table, draft_length)
    r.reset(rng)
    while not r.done:
        r.step(decide(r))
    return r


def on_grid(period: int):
    """A ``decide(replay)`` refreshing at the first round past each multiple of ``period`` generated tokens, onto
    the last grid point (that multiple, when ``period`` is one of the grid's and the round comes within a grid
    cell). ``PeriodicController`` counts its period from the round it refreshed in instead, which can land up to
    grid - 1 tokens after the point it scores: with a selection that covers about one period of a copy, that phase
    decides the AL (docs/paper-regime.md). A period below the grid refreshes once per grid point, the finest a
    table holds."""
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ValueError(f"period must be a positive integer of generated tokens, got {period!r}")

    def decide(r: Replay) -> bool:
        return (r.length - r.P) // period * period // r.G > r.row

    return decide


def replay_counts(tables, decide, draft_length: int = 11, episodes: int = 8, seed: int = 0) -> dict:
    """A schedule's point on a tradeoff curve over ``tables`` (the keys ``rift_ada.sweep.counts`` gives an
    evaluation): :func:`table_replays`, each table's AL and counts averaged over its replays; AL then averaged over
    tables, counts summed."""
    return merge_tables([table_point(runs) for runs in table_replays(tables, decide, draft_length, episodes, seed)])


def table_replays(tables, decide, draft_length: int = 11, episodes: int = 8, seed: int = 0) -> list[list[Replay]]:
    """Each table's finished replays: ``episodes`` when sampling (once greedy), drawn from a generator seeded
    ``seed`` + the table's index. ``decide``: a controller (deciding on the signals; None: never) or a function of
    the Replay."""
    from ..refresh.base import refresh_wanted

    if decide is None or hasattr(decide, "decide"):  # a controller (None: never refresh) reads the signals
        fn = lambda r: refresh_wanted(decide, r.state)  # noqa: E731
    else:
        fn = decide
    out = []
    for i, table in enumerate(tables):
        rng = np.random.default_rng(seed + i)
        out.append([replay(table, fn, draft_length, rng) for _ in range(1 if table.temperature == 0 else episodes)])
    return out


def full_counts(tables, draft_length: int = 11, episodes: int = 8, seed: int = 0) -> dict:
    """The full-cache draft's point over ``tables`` (each table's ``full_q`` row in every row: exact, no selection)."""
    return replay_counts([full_table(t) for t in tables], None, draft_length, episodes, seed)


def full_table(table: ReplayTable) -> ReplayTable:
    """``table`` with the full-cache draft's acceptance in every row (replays the full cache exactly)."""
    return ReplayTable(**{**table.__dict__, "q": np.broadcast_to(table.full_q, table.q.shape)})


def table_point(runs: list[Replay]) -> dict:
    """One table's AL and counts, averaged over its replays."""
    return {"acceptance_length": float(np.mean([r.acceptance_length() for r in runs])),
            "refreshes": float(np.mean([r.refreshes for r in runs])), "tokens": float(np.mean([r.g for r in runs])),
            "rounds": float(np.mean([len(r.rounds) for r in runs])),
            "drafted": float(np.mean([sum(x.draft_length for x in r.rounds) for r in runs]))}


def merge_tables(per: list[dict]) -> dict:
    """Per-table numbers as one point: AL the mean over tables, counts summed, refreshes per 1K over all tokens."""
    def total(key):  # a count stays an integer when every table's is (greedy: one replay each)
        x = sum(p[key] for p in per)
        return int(x) if float(x).is_integer() else x

    tokens = total("tokens")
    return {"acceptance_length": float(np.mean([p["acceptance_length"] for p in per])),
            "refreshes_per_1k": 1000 * sum(p["refreshes"] for p in per) / tokens, "refreshes": total("refreshes"),
            "tokens": tokens, "rounds": total("rounds"), "drafted": total("drafted"),
            "al_std": 0.0, "refreshes_per_1k_std": 0.0, "per_prompt": per}
