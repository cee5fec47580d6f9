"""A logistic refresh controller: P(refreshing now pays off) from the signals, trained on refresh labels.

Fitting uses scikit-learn and lives above the core (``rift_ada.controllers.logistic.fit_logistic``); deciding does
not. The fitted, standardised model folds into one weight vector and a bias (``w . (x - mean) / scale + b``), which
is all ``decide`` and the exported JSON hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .. import signals
from .base import GapRule, check_observation, number, numbers, read_json, write_controller_file
from .registry import register


@register
@dataclass
class LogisticController(GapRule):
    kind: ClassVar[str] = "logistic"
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bias: float = 0.0
    threshold: float = 0.5  # refresh when P(refresh helps) exceeds this: the knob of the tradeoff curve
    min_gap: int = 0
    name: str = "logistic"

    def probability(self, observation) -> float:
        obs = check_observation(observation).astype(np.float64)
        if self.weights.shape != obs.shape:
            raise ValueError("this logistic controller is not fitted (or was fitted on other signals)")
        return float(1.0 / (1.0 + np.exp(-(obs @ self.weights + self.bias))))

    def fires(self, obs: np.ndarray) -> bool:
        return self.probability(obs) > self.threshold

    def save(self, path) -> None:
        write_controller_file(path, {"kind": "logistic", "weights": self.weights.tolist(), "bias": self.bias,
                          "threshold": self.threshold, "min_gap": self.min_gap})

    @classmethod
    def load(cls, path) -> "LogisticController":
        d = read_json(path, "logistic")
        return cls(weights=np.asarray(numbers(d, "weights", path, len(signals.NAMES)), dtype=np.float64),
                   bias=number(d, "bias", path), threshold=number(d, "threshold", path, minimum=0, maximum=1),
                   min_gap=number(d, "min_gap", path, integer=True, minimum=0, default=0))
