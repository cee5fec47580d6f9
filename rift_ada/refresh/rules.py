"""Rule controllers: never (RIFT-stat), periodic (RIFT-dyn), thresholds over any signal, and the entropy rule."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .. import signals
from .base import (Controller, GapRule, Knob, check_observation, is_number, number, read_json, short,
                   since_refresh, write_controller_file)
from .registry import register

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


@register
@dataclass
class NeverController(Controller):
    kind: ClassVar[str] = "never"
    spelling: ClassVar[str] = "never"
    knob: ClassVar[Knob] = Knob()  # one point: RIFT-stat

    def decide(self, observation) -> bool:
        check_observation(observation)
        return False

    def save(self, path) -> None:
        write_controller_file(path, {"kind": "never"})

    @classmethod
    def load(cls, path) -> "NeverController":
        read_json(path, "never")
        return cls()

    @classmethod
    def at(cls, value) -> "NeverController":
        return cls()


@register
@dataclass
class PeriodicController(Controller):
    """Refresh once ``period`` tokens have been generated since the last scoring (RIFT-dyn as a controller)."""

    kind: ClassVar[str] = "periodic"
    spelling: ClassVar[str] = "periodic:N"
    knob: ClassVar[Knob] = Knob("periods", int, (16, 32, 64, 128), "periodic refresh: generated tokens between "
                                "refreshes", low=1, high=int(signals.SINCE_SCALE))
    period: int = 64

    def __post_init__(self):
        if not 1 <= self.period <= signals.SINCE_SCALE:
            raise ValueError(f"period must be between 1 and {signals.SINCE_SCALE:.0f} generated tokens (the range "
                             f"of the since_refresh signal), got {self.period}")

    def decide(self, observation) -> bool:
        return since_refresh(check_observation(observation)) >= self.period

    def save(self, path) -> None:
        write_controller_file(path, {"kind": "periodic", "period": self.period})

    @classmethod
    def load(cls, path) -> "PeriodicController":
        return cls(period=number(read_json(path, "periodic"), "period", path, integer=True, minimum=1,
                                 maximum=int(signals.SINCE_SCALE)))

    @classmethod
    def from_spec(cls, arg: str, spec: str) -> "PeriodicController":
        try:
            return cls(int(arg))
        except ValueError:
            raise ValueError(f"--controller {spec!r}: write periodic:N with N >= 1 generated tokens between "
                             "refreshes") from None


@register
@dataclass
class ThresholdController(GapRule):
    """Refresh when any rule fires, e.g. ``[("acc_mean", "<", 0.5), ("drift", ">", 0.2)]``, but not within
    ``min_gap`` tokens of the last scoring (low acceptance right after a refresh is not staleness)."""

    kind: ClassVar[str] = "threshold"
    knob: ClassVar[Knob] = Knob("acc_thresholds", float, (0.5, 0.85), "threshold rule: refresh when acc_mean < x",
                                low=0, high=1, open=True)
    rules: list = field(default_factory=lambda: [("acc_mean", "<", 0.5)])
    min_gap: int = 16

    def __post_init__(self):
        self.rules = [tuple(r) for r in self.rules]
        for sig, op, _ in self.rules:
            signals.index(sig)
            if op not in _OPS:
                raise ValueError(f"unknown comparison {op!r}; use one of {', '.join(_OPS)}")

    def fires(self, obs: np.ndarray) -> bool:
        return any(_OPS[op](float(obs[signals.index(sig)]), value) for sig, op, value in self.rules)

    def save(self, path) -> None:
        write_controller_file(path, {"kind": "threshold", "rules": [list(r) for r in self.rules], "min_gap": self.min_gap})

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

    @classmethod
    def at(cls, value) -> "ThresholdController":
        return cls([("acc_mean", "<", value)])


@register
@dataclass
class EntropyController(GapRule):
    """Refresh when the last round's mean draft entropy exceeds ``threshold`` (the entropy-triggered baseline of the
    literature), but not within ``min_gap`` tokens of the last scoring, as the threshold rule.

    ``threshold`` is in the unit of the ``entropy_mean`` signal: mean entropy over the round's draft steps, in nats,
    divided by ln(vocab size), so in [0, 1] (a controller sees only the signals, never the vocabulary). The same
    decision as ``ThresholdController([("entropy_mean", ">", threshold)], min_gap)``, with its own name and knob.
    """

    kind: ClassVar[str] = "entropy"
    spelling: ClassVar[str] = "entropy:X"
    knob: ClassVar[Knob] = Knob("entropy_quantiles", float, (0.9,), "entropy rule: refresh when the last round's mean "
                                "draft entropy exceeds these quantiles of the observed draft entropies (the "
                                "labelled replay states; the rift-stat run's in the figures): the knob reported is the "
                                "entropy level", low=0, high=1, open=True,
                                quantiles_of="entropy_mean")
    threshold: float = 0.1
    min_gap: int = 16

    def __post_init__(self):
        if not is_number(self.threshold) or not 0 <= self.threshold <= 1:
            raise ValueError(f"the entropy threshold is the entropy_mean signal's level (mean draft entropy / ln vocab), "
                             f"a number in [0, 1]; got {self.threshold!r}")
        if not isinstance(self.min_gap, int) or self.min_gap < 0:
            raise ValueError(f"min_gap must be an integer >= 0 generated tokens, got {self.min_gap!r}")

    def fires(self, obs: np.ndarray) -> bool:
        return float(obs[signals.index("entropy_mean")]) > self.threshold

    def save(self, path) -> None:
        write_controller_file(path, {"kind": "entropy", "threshold": self.threshold, "min_gap": self.min_gap})

    @classmethod
    def load(cls, path) -> "EntropyController":
        data = read_json(path, "entropy")
        return cls(threshold=number(data, "threshold", path, minimum=0, maximum=1),
                   min_gap=number(data, "min_gap", path, integer=True, minimum=0, default=16))

    @classmethod
    def from_spec(cls, arg: str, spec: str) -> "EntropyController":
        try:
            return cls(float(arg))
        except ValueError:
            hint = ""
            try:
                if float(arg) > 1:  # nats, probably: say how to convert
                    hint = (f"; X is not in nats: {float(arg):g} nats with a 32K vocabulary is "
                            f"entropy:{float(arg) / math.log(32000):.3f}")
            except ValueError:
                pass
            raise ValueError(f"--controller {spec!r}: write entropy:X with X in [0, 1], the level of the entropy_mean "
                             f"signal (mean draft entropy / ln vocab) above which to refresh{hint}") from None
