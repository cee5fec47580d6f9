"""Counterfactual refresh labels: from one decoder state, fork three branches that refresh now, ``delay`` rounds
later, or not at all, and compare what the next ``horizon`` rounds accept.

Two labels come from the same forks:
- ``wait`` (the default, what the main job fits): refresh now beats refreshing ``delay`` rounds later, i.e. waiting
  costs acceptance. This asks *when*: a selection about to go stale is worth refreshing now, one that still serves
  the next rounds is not (waiting loses nothing, and a later refresh lasts longer).
- ``now``: refresh now beats never refreshing within the horizon. This asks *whether*, and is true long before the
  selection goes stale (any refresh in the horizon helps once the stale point lies inside it), so a controller
  fitted on it refreshes early and often (the ablation in the README).

States come from trajectories that refresh on a random period per prompt, so the data covers fresh and stale caches.
Greedy branches are deterministic; sampled branches share their random numbers (the fork copies the generator).
Under torchrun :func:`collect` shares the prompts out across the processes (``rift_ada.distributed``) and gathers
the same data one process collects.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from rift_ada import distributed, signals
from rift_ada.refresh import PeriodicController, refresh_wanted


LABELS = ("wait", "now")


@dataclass
class CounterfactualData:
    X: np.ndarray  # (n, signals) observations at the fork
    gain: np.ndarray  # (n,) accepted drafts per round, refresh-now branch minus keep branch
    horizon: int
    wait: np.ndarray | None = None  # (n,) accepted drafts per round, refresh-now branch minus refresh-later branch

    def labels(self, margin: float = 0.0, label: str = "wait") -> np.ndarray:
        """1 where refreshing now gained more than ``margin`` accepted tokens over the horizon: over refreshing
        later (``wait``) or over not refreshing (``now``); module docstring."""
        if label not in LABELS:
            raise ValueError(f"label must be one of {', '.join(LABELS)}, got {label!r}")
        gain = self.gain if label == "now" else self.wait
        return (gain * self.horizon > margin).astype(int)


def _mean_accepted(decoder, refresh_at: int | None, horizon: int) -> float:
    """Mean accepted drafts over ``horizon`` rounds, refreshing once at round ``refresh_at`` (None: never)."""
    acc = []
    for i in range(horizon):
        if decoder.done:
            break
        acc.append(decoder.step(i == refresh_at).accepted)
    return float(np.mean(acc)) if acc else 0.0


def _branch(decoder, temperature: float | None):
    fork = decoder.fork()
    if temperature is not None:
        fork.temperature = temperature
    return fork


def behaviour_periods(n: int, period_range: tuple[int, int] = (16, 192), seed: int = 0) -> list[int]:
    """The behaviour seed of each prompt's data trajectory (drawn up front: prompt i's data depends on i alone)."""
    rng = random.Random(seed)
    return [rng.randint(*period_range) for _ in range(n)]


class Behaviour:
    """The data trajectories' refresh schedule: periodic, with a new period drawn from ``period_range`` after every
    refresh, so one prompt's states range from just refreshed to long stale whatever its task."""

    def __init__(self, period_range: tuple[int, int], seed: int):
        self.rng, self.range = random.Random(seed), period_range
        self.period = self.rng.randint(*period_range)

    def decide(self, state) -> bool:
        if state.tokens_since_refresh >= self.period:
            self.period = self.rng.randint(*self.range)
            return True
        return False


def collect_prompt(decoder, ids: list[int], max_new_tokens: int, period: int | tuple[int, int], horizon: int = 8,
                   every: int = 2,
                   per_prompt: int | None = 24, delay: int = 1, branch_temperature: float | None = None,
                   behaviour_seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One prompt's (observations, gains over keeping, gains over waiting ``delay`` rounds): a unit of work that
    depends only on its arguments (``decoder.reset`` reseeds the decoder), so jobs can store it and resume between
    prompts. ``period``: the trajectory refreshes every ``period`` tokens, or, given a (lo, hi) range, after a new
    period drawn from it each time (:class:`Behaviour`). The trajectory samples at the decoder's temperature; ``branch_temperature`` (e.g. 0) decodes the
    branches at another one: greedy branches compare the cache's coverage without the noise of sampled tokens."""
    if not 1 <= delay < horizon:
        raise ValueError(f"delay must be between 1 and horizon - 1 ({horizon - 1}), got {delay}")
    X, gains, waits = [], [], []
    # One period, or a new one from the (lo, hi) range after every refresh (``Behaviour``, seeded by behaviour_seed).
    behaviour = Behaviour(period, behaviour_seed) if isinstance(period, tuple) else PeriodicController(period)
    decoder.reset(ids, max_new_tokens)
    r, labelled, next_pos = 0, 0, 0
    spacing = max_new_tokens / per_prompt if per_prompt else 0
    while not decoder.done:
        pos = len(decoder.result.tokens)
        if r % every == 0 and decoder.tokens_since_refresh > 0 and pos >= next_pos:
            labelled += 1
            next_pos = labelled * spacing
            obs = signals.observe(decoder.state)
            now = _mean_accepted(_branch(decoder, branch_temperature), 0, horizon)
            gains.append(now - _mean_accepted(_branch(decoder, branch_temperature), None, horizon))
            waits.append(now - _mean_accepted(_branch(decoder, branch_temperature), delay, horizon))
            X.append(obs)
        decoder.step(behaviour.decide(decoder.state) if isinstance(behaviour, Behaviour)
                     else refresh_wanted(behaviour, decoder.state))
        r += 1
    return (np.asarray(X, dtype=np.float32).reshape(-1, len(signals.NAMES)), np.asarray(gains, dtype=np.float64),
            np.asarray(waits, dtype=np.float64))


def collect(decoder, prompts: list[list[int]], max_new_tokens: int, horizon: int = 8, every: int = 2,
            period_range: tuple[int, int] = (16, 192), seed: int = 0, per_prompt: int | None = 24,
            progress: bool = True, delay: int = 1, branch_temperature: float | None = None) -> CounterfactualData:
    """Label every ``every``-th round of each prompt's trajectory (``horizon`` rounds per branch), at most
    ``per_prompt`` states per prompt, spread over the generation (a stale cache makes many one-token rounds).

    Under torchrun (once ``rift_ada.distributed.init`` has joined the group; every process calls this with the same
    prompts and settings) each process labels its strided share of the prompts and every process returns the whole
    data, in prompt order: the same as one process's (a prompt's data depends on its own arguments alone)."""
    periods = behaviour_periods(len(prompts), period_range, seed)
    mine = []
    for i, ids in tqdm(distributed.shard(prompts), desc="counterfactual data",
                       disable=not progress or not distributed.is_main()):
        with distributed.on_shard(i):
            mine.append((i, collect_prompt(decoder, ids, max_new_tokens, periods[i], horizon, every, per_prompt,
                                           delay, branch_temperature)))
    parts = distributed.gather(mine)  # every process's share, in prompt order
    empty = (np.zeros((0, len(signals.NAMES)), np.float32), np.zeros(0), np.zeros(0))
    return CounterfactualData(np.concatenate([p[0] for p in [empty, *parts]]),
                              np.concatenate([p[1] for p in [empty, *parts]]), horizon,
                              np.concatenate([p[2] for p in [empty, *parts]]))
