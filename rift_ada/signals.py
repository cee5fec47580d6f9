"""The refresh signals: one float32 vector per round, with fixed names, order and bounds.

Shared by the Gymnasium environment, every controller and the exported controller files, so a controller trained
in the environment reads the same vector the decoding loop gives it.

| name            | meaning                                                                 | bounds |
|-----------------|-------------------------------------------------------------------------|--------|
| `acc_1..acc_H`  | accepted drafts / k of the last H rounds, most recent first (1.0 before any round) | [0, 1] |
| `acc_mean`      | mean of the above                                                       | [0, 1] |
| `entropy_mean`  | draft entropy of the last round, mean over its draft steps, / ln(vocab) | [0, 1] |
| `entropy_max`   | the same, max over the round's draft steps                              | [0, 1] |
| `drift`         | query drift since the last scoring (1 - cosine of mean queries)         | [0, 1] |
| `since_refresh` | generated tokens since the last scoring / 4096                          | [0, 1] |
| `position`      | generated tokens / max_new_tokens                                       | [0, 1] |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HISTORY = 4
SINCE_SCALE = 4096.0  # a power of two: since_refresh * SINCE_SCALE is exactly the token count (up to the cap)
NAMES = tuple(f"acc_{i + 1}" for i in range(HISTORY)) + (
    "acc_mean", "entropy_mean", "entropy_max", "drift", "since_refresh", "position")
LOW = np.zeros(len(NAMES), dtype=np.float32)
HIGH = np.ones(len(NAMES), dtype=np.float32)


@dataclass(frozen=True)
class DecoderState:
    """What a refresh decision may look at between rounds: published by the decoder (``SpeculativeDecoder.state``),
    read by :func:`observe`."""

    generated: int  # tokens generated so far
    max_new_tokens: int
    rounds: int
    tokens_since_refresh: int
    drift: float  # query drift since the last scoring (computed once per round)
    acceptance: tuple[float, ...]  # accepted / k of the last HISTORY rounds, most recent first
    entropy_mean: float  # of the last round (0 before any round)
    entropy_max: float
    vocab_size: int


def index(name: str) -> int:
    if name not in NAMES:
        raise ValueError(f"unknown signal {name!r}; signals are: {', '.join(NAMES)}")
    return NAMES.index(name)


def observe(state: DecoderState) -> np.ndarray:
    """The signal vector of a decoder's published state (``SpeculativeDecoder.state``): a pure function of it."""
    acc = list(state.acceptance[:HISTORY]) + [1.0] * (HISTORY - len(state.acceptance[:HISTORY]))
    log_v = math.log(state.vocab_size)
    vec = acc + [
        sum(acc) / HISTORY,
        state.entropy_mean / log_v,
        state.entropy_max / log_v,
        state.drift,
        state.tokens_since_refresh / SINCE_SCALE,
        state.generated / state.max_new_tokens,
    ]
    return np.clip(np.asarray(vec, dtype=np.float32), LOW, HIGH)
