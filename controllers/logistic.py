"""The logistic controller family: P(refreshing now pays off) from the signals, fitted to the oracle's decisions over
replay tables (:meth:`LogisticController.train`, in the main job).

Fitting uses scikit-learn (:func:`fit_logistic`); loading and deciding do not. The fitted, standardised model folds into one weight vector and a bias (``w . (x - mean) / scale + b``), which
is all ``decide`` and the exported JSON hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from rift_ada import signals
from rift_ada.refresh.base import GapRule, Knob, check_observation, number, numbers, read_json, write_controller_file
from rift_ada.refresh.registry import register


@register
@dataclass
class LogisticController(GapRule):
    kind: ClassVar[str] = "logistic"
    knob: ClassVar[Knob] = Knob("logistic_thresholds", float, (), "the logistic controller's thresholds swept "
                                "(default: chosen as the tree's level)", low=0, high=1, open=True, field="threshold")
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bias: float = 0.0
    threshold: float = 0.5  # refresh when P(refresh helps) exceeds this: the knob of the tradeoff curve
    min_gap: int = 0

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

    @classmethod
    def train(cls, job) -> list:
        fitted = job.imitate(cls, lambda X, y, w: fit_logistic(X, y, seed=job.args.seed, sample_weight=w))
        return [(x, replace(fitted, threshold=x)) for x in job.levels(cls, fitted)]


def fit_logistic(X: np.ndarray, y: np.ndarray, C: float = 1.0, seed: int = 0, sample_weight=None,
                 **kw) -> LogisticController:
    """Fit on signal vectors ``X`` and labels ``y`` (1 = refreshing at that state paid off), each state weighted by
    ``sample_weight`` if given. ``kw`` go to the
    controller (``threshold``, ``min_gap``). The scikit-learn pipeline stays on ``.sklearn_model`` for parity
    checks; it is never saved."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X, y = np.asarray(X, dtype=np.float64), np.asarray(y).astype(int)
    if len(np.unique(y)) < 2:
        raise ValueError("the labels hold a single class: label more states, or change the refresh price")
    pipe = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=1000, random_state=seed))
    pipe.fit(X, y, logisticregression__sample_weight=sample_weight)
    scaler, lr = pipe[0], pipe[1]
    w = lr.coef_[0] / scaler.scale_
    b = float(lr.intercept_[0] - (lr.coef_[0] * scaler.mean_ / scaler.scale_).sum())
    ctrl = LogisticController(weights=w, bias=b, **kw)
    ctrl.sklearn_model = pipe
    return ctrl


def learning_curve(X: np.ndarray, y: np.ndarray, sizes=(0.125, 0.25, 0.5, 1.0), holdout: float = 0.25,
                   seed: int = 0, fit=None) -> list[dict]:
    """A fit's learning curve (``fit(X, y, seed=...)``, default :func:`fit_logistic`): fitted on growing shares of a shuffled ``1 - holdout`` part of the states,
    scored on the other part (log-loss and accuracy of its 0.5 decision). One dict per size whose training states
    hold both labels: ``train_states``, ``log_loss``, ``accuracy``, ``positive_rate`` (held-out)."""
    from sklearn.metrics import log_loss

    X, y = np.asarray(X, dtype=np.float64), np.asarray(y).astype(int)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(holdout * len(y)))
    test, train = order[:n_test], order[n_test:]
    if n_test == 0 or len(np.unique(y[test])) < 2:
        return []
    curve = []
    for share in sizes:
        idx = train[: max(2, int(round(share * len(train))))]
        if len(np.unique(y[idx])) < 2:
            continue
        p = (fit or fit_logistic)(X[idx], y[idx], seed=seed).sklearn_model.predict_proba(X[test])[:, 1]
        curve.append({"train_states": int(len(idx)), "log_loss": float(log_loss(y[test], p, labels=[0, 1])),
                      "accuracy": float(((p > 0.5) == y[test]).mean()), "positive_rate": float(y[test].mean())})
    return curve
