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

import numpy as np

HISTORY = 4
SINCE_SCALE = 4096.0
NAMES = tuple(f"acc_{i + 1}" for i in range(HISTORY)) + (
    "acc_mean", "entropy_mean", "entropy_max", "drift", "since_refresh", "position")
LOW = np.zeros(len(NAMES), dtype=np.float32)
HIGH = np.ones(len(NAMES), dtype=np.float32)


def index(name: str) -> int:
    if name not in NAMES:
        raise ValueError(f"unknown signal {name!r}; signals are: {', '.join(NAMES)}")
    return NAMES.index(name)


def observe(decoder) -> np.ndarray:
    """The signal vector of a :class:`~rift_ada.speculative.SpeculativeDecoder` between rounds."""
    rounds = decoder.result.rounds
    acc = [r.accepted / r.draft_length if r.draft_length else 1.0 for r in rounds[-HISTORY:][::-1]]
    acc += [1.0] * (HISTORY - len(acc))
    log_v = math.log(decoder.draft.config.vocab_size)
    last = rounds[-1] if rounds else None
    vec = acc + [
        sum(acc) / HISTORY,
        last.entropy_mean / log_v if last else 0.0,
        last.entropy_max / log_v if last else 0.0,
        decoder.dcache.query_drift(),
        decoder.tokens_since_refresh / SINCE_SCALE,
        len(decoder.result.tokens) / decoder.max_new_tokens,
    ]
    return np.clip(np.asarray(vec, dtype=np.float32), LOW, HIGH)


def decider(controller):
    """``decoder -> bool``: observe the signals, ask the controller (the glue ``generate(decide=...)`` takes)."""
    return lambda decoder: bool(controller.decide(observe(decoder)))
