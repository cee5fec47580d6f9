"""Fitting the logistic refresh controller with scikit-learn on refresh labels
(the oracle's decisions over replay tables: ``rift_ada.trainers.oracle_labels``).

The fitted, standardised model folds into one weight vector and a bias: a ``rift_ada.refresh.LogisticController``,
which decides and saves without scikit-learn.
"""

from __future__ import annotations

import numpy as np

from rift_ada.refresh import LogisticController


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
