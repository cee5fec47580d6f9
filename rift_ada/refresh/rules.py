"""Rule controllers: never (RIFT-stat), periodic (RIFT-dyn), thresholds over any signal, and the entropy rule."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from .. import signals
from .base import check_observation, is_number, number, read_json, short, write_json

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


def _since(obs: np.ndarray) -> float:
    """Generated tokens since the last scoring: exact, since the signal divides by a power of two (up to its cap)."""
    return float(obs[signals.index("since_refresh")]) * signals.SINCE_SCALE


@dataclass
class NeverController:
    name: str = "never"

    def decide(self, observation) -> bool:
        check_observation(observation)
        return False

    def save(self, path) -> None:
        write_json(path, {"kind": "never"})

    @classmethod
    def load(cls, path) -> "NeverController":
        read_json(path, "never")
        return cls()


@dataclass
class PeriodicController:
    """Refresh once ``period`` tokens have been generated since the last scoring (RIFT-dyn as a controller)."""

    period: int = 64
    name: str = "periodic"

    def __post_init__(self):
        if not 1 <= self.period <= signals.SINCE_SCALE:
            raise ValueError(f"period must be between 1 and {signals.SINCE_SCALE:.0f} generated tokens (the range "
                             f"of the since_refresh signal), got {self.period}")

    def decide(self, observation) -> bool:
        return _since(check_observation(observation)) >= self.period

    def save(self, path) -> None:
        write_json(path, {"kind": "periodic", "period": self.period})

    @classmethod
    def load(cls, path) -> "PeriodicController":
        return cls(period=number(read_json(path, "periodic"), "period", path, integer=True, minimum=1,
                                 maximum=int(signals.SINCE_SCALE)))


@dataclass
class ThresholdController:
    """Refresh when any rule fires, e.g. ``[("acc_mean", "<", 0.5), ("drift", ">", 0.2)]``, but not within
    ``min_gap`` tokens of the last scoring (low acceptance right after a refresh is not staleness)."""

    rules: list = field(default_factory=lambda: [("acc_mean", "<", 0.5)])
    min_gap: int = 16
    name: str = "threshold"

    def __post_init__(self):
        self.rules = [tuple(r) for r in self.rules]
        for sig, op, _ in self.rules:
            signals.index(sig)
            if op not in _OPS:
                raise ValueError(f"unknown comparison {op!r}; use one of {', '.join(_OPS)}")

    def decide(self, observation) -> bool:
        obs = check_observation(observation)
        if _since(obs) < self.min_gap:
            return False
        return any(_OPS[op](float(obs[signals.index(sig)]), value) for sig, op, value in self.rules)

    def save(self, path) -> None:
        write_json(path, {"kind": "threshold", "rules": [list(r) for r in self.rules], "min_gap": self.min_gap})

    @classmethod
    def load(cls, path) -> "ThresholdController":
        data = read_json(path, "threshold")
        rules = data.get("rules")
        if not isinstance(rules, list) or not rules:
            raise ValueError(f"{path}: 'rules' must be a non-empty list of [signal, comparison, value], "
                             f"got {short(rules)}")
        for r in rules:
            if not (isinstance(r, list) and len(r) == 3 and r[0] in signals.NAMES and isinstance(r[1], str)
                    and r[1] in _OPS and is_number(r[2])):
                raise ValueError(f"{path}: each rule must be [signal, comparison, number] with a signal among "
                                 f"{', '.join(signals.NAMES)} and a comparison among {', '.join(_OPS)}, got {short(r)}")
        return cls(rules=[tuple(r) for r in rules], min_gap=number(data, "min_gap", path, integer=True, minimum=0))


@dataclass
class EntropyController:
    """Refresh when the last round's mean draft entropy exceeds ``threshold`` (the entropy-triggered baseline of the
    literature), but not within ``min_gap`` tokens of the last scoring, as the threshold rule.

    ``threshold`` is in the unit of the ``entropy_mean`` signal: mean entropy over the round's draft steps, in nats,
    divided by ln(vocab size), so in [0, 1] (a controller sees only the signals, never the vocabulary). The same
    decision as ``ThresholdController([("entropy_mean", ">", threshold)], min_gap)``, with its own name and knob.
    """

    threshold: float = 0.1
    min_gap: int = 16
    name: str = "entropy"

    def __post_init__(self):
        if not is_number(self.threshold) or not 0 <= self.threshold <= 1:
            raise ValueError(f"the entropy threshold is the entropy_mean signal's level (mean draft entropy / ln vocab), "
                             f"a number in [0, 1]; got {self.threshold!r}")
        if not isinstance(self.min_gap, int) or self.min_gap < 0:
            raise ValueError(f"min_gap must be an integer >= 0 generated tokens, got {self.min_gap!r}")

    def decide(self, observation) -> bool:
        obs = check_observation(observation)
        return _since(obs) >= self.min_gap and float(obs[signals.index("entropy_mean")]) > self.threshold

    def save(self, path) -> None:
        write_json(path, {"kind": "entropy", "threshold": self.threshold, "min_gap": self.min_gap})

    @classmethod
    def load(cls, path) -> "EntropyController":
        data = read_json(path, "entropy")
        return cls(threshold=number(data, "threshold", path, minimum=0, maximum=1),
                   min_gap=number(data, "min_gap", path, integer=True, minimum=0, default=16))
