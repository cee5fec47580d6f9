"""Refresh labels from replay tables: the oracle's decision at the states a behaviour visits.

The oracle (``rift_ada.replay.oracle``) knows, for every state of a table (tokens generated, pending, row in force),
whether refreshing now is part of the cheapest schedule at a refresh price. A controller sees only the signals, so
it learns the oracle's decisions from (observation, decision) pairs: at the states some behaviour reaches in replay
(random periodic schedules: fresh, ageing and stale selections alike), then, DAgger-style, at the states the fitted
controller itself reaches (its own mistakes included), refitted on everything. Every state of every round is
labelled exactly: no forked decoder, no horizon, no margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from rift_ada import signals
from rift_ada.replay.oracle import OracleSchedule, solve
from rift_ada.replay.process import Replay
from rift_ada.replay.table import ReplayTable


@dataclass
class LabelledStates:
    X: np.ndarray  # (n, signals) observations
    y: np.ndarray  # (n,) 1 where the oracle refreshes
    table: np.ndarray  # (n,) the table each state came from
    weight: np.ndarray | None = None  # (n,) what the decision is worth: |cost of keeping - cost of refreshing|

    def __add__(self, other: "LabelledStates") -> "LabelledStates":
        return LabelledStates(np.concatenate([self.X, other.X]), np.concatenate([self.y, other.y]),
                              np.concatenate([self.table, other.table]), np.concatenate([self.weight, other.weight]))

    @property
    def positive_rate(self) -> float:
        return float(self.y.mean()) if len(self.y) else 0.0


def empty() -> LabelledStates:
    return LabelledStates(np.zeros((0, len(signals.NAMES)), np.float32), np.zeros(0, int), np.zeros(0, int),
                          np.zeros(0))


class RandomPeriods:
    """Refresh after a period drawn from ``period_range`` generated tokens, a new one after every refresh."""

    def __init__(self, period_range: tuple[int, int], rng: np.random.Generator):
        self.range, self.rng = period_range, rng
        self.period = int(rng.integers(period_range[0], period_range[1] + 1))

    def __call__(self, replay: Replay, obs: np.ndarray) -> bool:
        if replay.since >= self.period:
            self.period = int(self.rng.integers(self.range[0], self.range[1] + 1))
            return True
        return False


class Explore:
    """A controller's decisions, each flipped with probability ``eps`` (so its rollouts also reach the states one
    wrong decision leads to)."""

    def __init__(self, controller, eps: float, rng: np.random.Generator):
        self.controller, self.eps, self.rng = controller, eps, rng

    def __call__(self, replay: Replay, obs: np.ndarray) -> bool:
        act = bool(self.controller.decide(obs))
        return not act if self.rng.random() < self.eps else act


def label_states(tables: Sequence[ReplayTable], schedules: Sequence[OracleSchedule], draft_length: int,
                 behaviour: Callable[[np.random.Generator], Callable], episodes: int,
                 rng: np.random.Generator) -> LabelledStates:
    """``episodes`` replays of each table under ``behaviour(rng)`` (a new one per episode), every state labelled with
    the table's oracle decision."""
    X, y, which, weight = [], [], [], []
    for i, (table, schedule) in enumerate(zip(tables, schedules)):
        for _ in range(episodes):
            act = behaviour(rng)
            r = Replay(table, draft_length)
            r.reset(rng)
            while not r.done:
                obs = signals.observe(r.state)
                X.append(obs)
                y.append(schedule.refreshes(r))
                weight.append(abs(schedule.gain[r.g, min(r.pending, 2) - 1, r.row]))
                which.append(i)
                r.step(act(r, obs))
    if not X:
        return empty()
    return LabelledStates(np.asarray(X, np.float32), np.asarray(y, int), np.asarray(which, int),
                          np.asarray(weight, np.float64))


@dataclass
class ImitationResult:
    controller: object
    data: LabelledStates
    history: list = field(default_factory=list)  # per round: states, positive rate, training accuracy


def demonstrations(tables: Sequence[ReplayTable], schedules: Sequence[OracleSchedule], draft_length: int,
                   period_range: tuple[int, int] = (16, 192), episodes: int = 4, seed: int = 0):
    """(X, y, weights) for behaviour cloning (``rift_ada.trainers.ppo.clone``): the ``schedules``' decisions (e.g. the
    oracles whose cost is an env's reward: ``ReplayEnv(shaping=True).oracles``) at the states of random periodic
    schedules. Deterministic given ``seed``."""
    data = label_states(tables, schedules, draft_length, lambda g: RandomPeriods(tuple(period_range), g), episodes,
                        np.random.default_rng(seed))
    return data.X, data.y, data.weight


def reward_demonstrations(tables: Sequence[ReplayTable], env: dict, period_range: tuple[int, int] = (16, 192),
                          episodes: int = 4, seed: int = 0):
    """:func:`demonstrations` of the oracles whose cost is the reward of ``ReplayEnv(tables, **env)`` (its lambda,
    reward kind and costs), so a clone starts where that reward's optimum is."""
    from rift_ada.envs import ReplayEnv

    oracles = ReplayEnv(tables, **{**env, "shaping": True}).oracles
    return demonstrations(tables, oracles, env.get("draft_length", 11), period_range, episodes, seed)


def imitate(tables: Sequence[ReplayTable], fit: Callable[..., object], draft_length: int = 11,
            refresh_price: float = 4.0, rounds: int = 2, episodes: int = 4, period_range: tuple[int, int] = (16, 192),
            eps: float = 0.1, seed: int = 0, schedules: Sequence[OracleSchedule] | None = None,
            weighted: bool = True) -> ImitationResult:
    """Fit a controller (``fit(X, y, sample_weight) -> controller``) to the oracle's decisions at ``refresh_price``:
    first on states of random periodic schedules, then ``rounds - 1`` times more on those states plus the ones the
    last fit reaches (its decisions flipped with probability ``eps``). With ``weighted`` each state counts by what
    the decision is worth there (the oracle's cost difference between its two actions, in rounds): a state where
    both cost the same teaches nothing, one where a wrong decision costs three rounds teaches much.
    Deterministic given ``seed``."""
    rng = np.random.default_rng(seed)
    if schedules is None:
        schedules = [solve(t, draft_length, refresh_price) for t in tables]
    data = label_states(tables, schedules, draft_length, lambda g: RandomPeriods(period_range, g), episodes, rng)
    history, ctrl = [], None
    for i in range(rounds):
        if i:
            data = data + label_states(tables, schedules, draft_length, lambda g: Explore(ctrl, eps, g), episodes, rng)
        if len(np.unique(data.y)) < 2:
            raise ValueError(f"the oracle's decisions at price {refresh_price:g} hold a single class on these tables "
                             "(it always or never refreshes): change the refresh price")
        ctrl = fit(data.X, data.y, data.weight if weighted else None)
        history.append({"round": i, "states": int(len(data.y)), "positive_rate": data.positive_rate})
    return ImitationResult(ctrl, data, history)
