"""A logistic refresh controller: P(refreshing now pays off) from the signals, trained on counterfactual labels.

Fitting uses scikit-learn; deciding does not. The fitted, standardised model folds into one weight vector and a bias
(``w . (x - mean) / scale + b``), which is all ``decide`` and the exported JSON hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rift_ada import signals

from .base import check_observation, number, numbers, read_json, write_json


@dataclass
class LogisticController:
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bias: float = 0.0
    threshold: float = 0.5  # refresh when P(refresh helps) exceeds this: the knob of the tradeoff curve
    min_gap: int = 0
    name: str = "logistic"

    def reset(self) -> None:
        pass

    def probability(self, observation) -> float:
        obs = check_observation(observation).astype(np.float64)
        if self.weights.shape != obs.shape:
            raise ValueError("this logistic controller is not fitted (or was fitted on other signals)")
        return float(1.0 / (1.0 + np.exp(-(obs @ self.weights + self.bias))))

    def decide(self, observation) -> bool:
        from .rules import _since

        obs = check_observation(observation)
        return _since(obs) >= self.min_gap and self.probability(obs) > self.threshold

    @classmethod
    def fit(cls, X: np.ndarray, y: np.ndarray, C: float = 1.0, seed: int = 0, **kw) -> "LogisticController":
        """Fit on signal vectors ``X`` and labels ``y`` (1 = refreshing at that state paid off)."""
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        X, y = np.asarray(X, dtype=np.float64), np.asarray(y).astype(int)
        if len(np.unique(y)) < 2:
            raise ValueError("the counterfactual labels hold a single class: collect more data or change the margin")
        pipe = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=1000, random_state=seed))
        pipe.fit(X, y)
        scaler, lr = pipe[0], pipe[1]
        w = lr.coef_[0] / scaler.scale_
        b = float(lr.intercept_[0] - (lr.coef_[0] * scaler.mean_ / scaler.scale_).sum())
        ctrl = cls(weights=w, bias=b, **kw)
        ctrl.sklearn_model = pipe  # kept for parity checks; never saved
        return ctrl

    def save(self, path) -> None:
        write_json(path, {"kind": "logistic", "weights": self.weights.tolist(), "bias": self.bias,
                          "threshold": self.threshold, "min_gap": self.min_gap})

    @classmethod
    def load(cls, path) -> "LogisticController":
        d = read_json(path, "logistic")
        return cls(weights=np.asarray(numbers(d, "weights", path, len(signals.NAMES)), dtype=np.float64),
                   bias=number(d, "bias", path), threshold=number(d, "threshold", path, minimum=0, maximum=1),
                   min_gap=number(d, "min_gap", path, integer=True, minimum=0, default=0))
