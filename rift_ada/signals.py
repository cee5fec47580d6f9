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
| `runway`        | tokens the cache still holds right after the importance entry the draft reads most sharply now, / 64 | [0, 1] |
| `focus`         | the draft's largest attention weight on one importance entry now (its newest query)     | [0, 1] |
| `since_refresh` | generated tokens since the last scoring / 4096                          | [0, 1] |
| `position`      | generated tokens / max_new_tokens                                       | [0, 1] |

`runway` and `focus` come from the draft's newest query over its active cache (``RiftCache.read_ahead``): one small
matmul per layer, no extra model forward. While a model copies from far back, the runway counts down one per generated
token to where the selection stops; acceptance only falls once it has run out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HISTORY = 4
RUNWAY_CAP = 64  # tokens; the snapkv scorer's default lookahead, so a fresh selection reads ~1.0
SINCE_SCALE = 4096.0  # a power of two: since_refresh * SINCE_SCALE is exactly the token count (up to the cap)
NAMES = tuple(f"acc_{i + 1}" for i in range(HISTORY)) + (
    "acc_mean", "entropy_mean", "entropy_max", "drift", "runway", "focus", "since_refresh", "position")
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
    runway: float = 0.0  # tokens (RiftCache.read_ahead), capped at RUNWAY_CAP
    focus: float = 0.0


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
        state.runway / RUNWAY_CAP,
        state.focus,
        state.tokens_since_refresh / SINCE_SCALE,
        state.generated / state.max_new_tokens,
    ]
    return np.clip(np.asarray(vec, dtype=np.float32), LOW, HIGH)
