"""Counterfactual refresh labels: from one decoder state, fork, refresh in one branch and not in the other, and
compare what the next rounds accept. The label says whether refreshing *now* paid off.

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


@dataclass
class CounterfactualData:
    X: np.ndarray  # (n, signals) observations at the fork
    gain: np.ndarray  # (n,) accepted drafts per round, refresh branch minus keep branch
    horizon: int

    def labels(self, margin: float = 0.0) -> np.ndarray:
        """1 where refreshing gained more than ``margin`` accepted tokens over the horizon."""
        return (self.gain * self.horizon > margin).astype(int)


def _mean_accepted(decoder, first: bool, horizon: int) -> float:
    acc = []
    for i in range(horizon):
        if decoder.done:
            break
        acc.append(decoder.step(first if i == 0 else False).accepted)
    return float(np.mean(acc)) if acc else 0.0


def behaviour_periods(n: int, period_range: tuple[int, int] = (16, 192), seed: int = 0) -> list[int]:
    """The refresh period of each prompt's data trajectory (drawn up front: prompt i's data depends on i alone)."""
    rng = random.Random(seed)
    return [rng.randint(*period_range) for _ in range(n)]


def collect_prompt(decoder, ids: list[int], max_new_tokens: int, period: int, horizon: int = 8, every: int = 2,
                   per_prompt: int | None = 24) -> tuple[np.ndarray, np.ndarray]:
    """One prompt's (observations, gains): a unit of work that depends only on its arguments (``decoder.reset``
    reseeds the decoder), so jobs can store it and resume between prompts."""
    X, gains = [], []
    behaviour = PeriodicController(period)
    decoder.reset(ids, max_new_tokens)
    r, labelled, next_pos = 0, 0, 0
    spacing = max_new_tokens / per_prompt if per_prompt else 0
    while not decoder.done:
        pos = len(decoder.result.tokens)
        if r % every == 0 and decoder.tokens_since_refresh > 0 and pos >= next_pos:
            labelled += 1
            next_pos = labelled * spacing
            obs = signals.observe(decoder.state)
            gain = _mean_accepted(decoder.fork(), True, horizon) - _mean_accepted(decoder.fork(), False, horizon)
            X.append(obs)
            gains.append(gain)
        decoder.step(refresh_wanted(behaviour, decoder.state))
        r += 1
    return (np.asarray(X, dtype=np.float32).reshape(-1, len(signals.NAMES)), np.asarray(gains, dtype=np.float64))


def collect(decoder, prompts: list[list[int]], max_new_tokens: int, horizon: int = 8, every: int = 2,
            period_range: tuple[int, int] = (16, 192), seed: int = 0, per_prompt: int | None = 24,
            progress: bool = True) -> CounterfactualData:
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
            mine.append((i, collect_prompt(decoder, ids, max_new_tokens, periods[i], horizon, every, per_prompt)))
    parts = distributed.gather(mine)  # every process's share, in prompt order
    empty = (np.zeros((0, len(signals.NAMES)), np.float32), np.zeros(0))
    return CounterfactualData(np.concatenate([x for x, _ in [empty, *parts]]),
                              np.concatenate([g for _, g in [empty, *parts]]), horizon)
