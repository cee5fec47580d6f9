"""Fitting the logistic refresh controller with scikit-learn on counterfactual labels.

The fitted, standardised model folds into one weight vector and a bias: a ``rift_ada.refresh.LogisticController``,
which decides and saves without scikit-learn.
"""

from __future__ import annotations

import numpy as np

from rift_ada.refresh import LogisticController


def fit_logistic(X: np.ndarray, y: np.ndarray, C: float = 1.0, seed: int = 0, **kw) -> LogisticController:
    """Fit on signal vectors ``X`` and labels ``y`` (1 = refreshing at that state paid off). ``kw`` go to the
    controller (``threshold``, ``min_gap``). The scikit-learn pipeline stays on ``.sklearn_model`` for parity
    checks; it is never saved."""
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
    ctrl = LogisticController(weights=w, bias=b, **kw)
    ctrl.sklearn_model = pipe
    return ctrl
