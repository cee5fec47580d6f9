"""The refresh oracle: the best schedule over a replay table's grid, by dynamic programming.

State between rounds: (g tokens generated, p pending tokens, r the row in force). A round from (g, p, r), after
refreshing or not, drafts k = min(draft_length, max_new_tokens - g - 1) tokens under row r' (r, or the row of the
history length P + g - p when it refreshes), accepts n of them with the table's probabilities (greedy: the leading
run of matches, probability 1) and moves to (g + n + 1, 2 if n = k else 1, r'). Its cost is

    round_cost + draft_cost * k + refresh_price * [refreshed]

(``round_cost`` 1, the others 0 and ``refresh_price`` lam: rounds + lam x refreshes, i.e. acceptance length at a
refresh price of lam rounds; with a ``CostModel``, seconds). The oracle minimises the expected total cost from
the start: exact over the grid, knowing the continuation (the table) but, when sampling, not the coin flips of the
rejection rule (its schedule depends on the outcomes so far, as a controller's does). Sweeping the price traces its
acceptance-length-versus-refreshes curve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .process import Replay
from .table import ReplayTable


@dataclass
class OracleSchedule:
    """The oracle's decisions: ``refresh[g, pending - 1, row]`` at every state, and the expected cost from the
    start."""

    refresh: np.ndarray  # (N + 1, 2, rows) bool
    expected_cost: float
    refresh_price: float
    value: np.ndarray | None = None  # (N + 1, 2, rows): the expected cost to go from each state (0 once done)
    gain: np.ndarray | None = None  # (N + 1, 2, rows): cost of keeping minus cost of refreshing (> 0: refresh)

    def refreshes(self, replay: Replay) -> bool:
        """Whether the oracle refreshes at ``replay``'s state (a schedule over replay states, not a
        ``Controller``: it sees the table's state, not the signals)."""
        return self.at(replay.g, replay.pending, replay.row)

    def at(self, g: int, pending: int, row: int) -> bool:
        return bool(self.refresh[g, min(pending, 2) - 1, row])

    def cost_to_go(self, g: int, pending: int, row: int) -> float:
        """The expected cost from a state on (0 once the generation is done)."""
        return 0.0 if g >= self.value.shape[0] else float(self.value[g, min(pending, 2) - 1, row])


def solve(table: ReplayTable, draft_length: int = 11, refresh_price: float = 4.0, round_cost: float = 1.0,
          draft_cost: float = 0.0) -> OracleSchedule:
    """The expected-cost-optimal refresh policy over ``table`` (module docstring)."""
    if refresh_price < 0 or round_cost < 0 or draft_cost < 0:
        raise ValueError("the oracle's costs must be >= 0")
    k, P, G = draft_length, table.prompt_len, table.grid
    N, R, max_new = int(table.tokens.shape[0]), table.rows, table.max_new_tokens
    acc = np.concatenate([np.nan_to_num(table.accept().astype(np.float64), nan=0.0), np.zeros((R, k + 1))], 1)
    V = np.zeros((N + k + 2, 2, R))  # expected cost to go; 0 once g >= N
    refresh = np.zeros((N + 1, 2, R), dtype=bool)
    gain = np.zeros((N + 1, 2, R))
    rows = np.arange(R)
    for g in range(N - 1, 0, -1):
        ke = min(k, max_new - g - 1)
        a = acc[:, g:g + ke]  # (R, ke)
        c = np.cumprod(a, 1)
        before = np.concatenate([np.ones((R, 1)), c], 1)  # P(the first j drafts accepted), j = 0 .. ke
        prob = before * np.concatenate([1 - a, np.ones((R, 1))], 1)  # P(n = j)
        nxt = np.minimum(g + np.arange(ke + 1) + 1, N)
        pend = np.where(np.arange(ke + 1) == ke, 1 if ke > 0 else 0, 0)  # index of the next pending count
        future = V[nxt, pend][:, rows].T  # (R, ke + 1): cost to go after n = j, staying on each row
        keep = round_cost + draft_cost * ke + (prob * future).sum(1)
        for p in (1, 2):
            r_new = max(g - p, 0) // G
            go = keep[r_new] + refresh_price
            refresh[g, p - 1] = go < keep
            gain[g, p - 1] = keep - go
            V[g, p - 1] = np.minimum(keep, go)
    return OracleSchedule(refresh, float(V[1, 0, 0]), refresh_price, V[:N + 1], gain)


def oracle_rounds(table: ReplayTable, policy: OracleSchedule, draft_length: int = 11, episodes: int = 1,
                  seed: int = 0) -> list[Replay]:
    """``episodes`` replays of the oracle's policy (one suffices greedy): its acceptance length and refreshes."""
    from .process import replay

    rng = np.random.default_rng(seed)
    return [replay(table, policy.refreshes, draft_length, rng) for _ in range(1 if table.temperature == 0 else episodes)]


def oracle_counts(tables, draft_length: int = 11, refresh_price: float = 4.0, episodes: int = 8,
                  seed: int = 0, **costs) -> dict:
    """The oracle's point on a tradeoff curve over ``tables`` (``rift_ada.replay.process.replay_counts``'s keys):
    each table's own optimal policy at ``refresh_price``, replayed ``episodes`` times when sampling."""
    from .process import merge_tables, table_point

    return merge_tables([table_point(oracle_rounds(table, solve(table, draft_length, refresh_price, **costs),
                                                   draft_length, episodes, seed + i))
                         for i, table in enumerate(tables)])
