"""Fitting the decision-tree refresh controller with scikit-learn on refresh labels
(the oracle's decisions over replay tables: ``rift_ada.trainers.oracle_labels``).

The fitted tree is copied node by node into a ``rift_ada.refresh.TreeController``, which decides and saves without
scikit-learn.
"""

from __future__ import annotations

import numpy as np

from rift_ada.refresh import TreeController


def fit_tree(X: np.ndarray, y: np.ndarray, max_depth: int = 3, min_samples_leaf: int = 10, seed: int = 0,
             ignore: tuple = (), sample_weight=None, **kw) -> TreeController:
    """Fit on signal vectors ``X`` and labels ``y`` (1 = refreshing at that state paid off); ``ignore`` names signals
    no split may use (held constant during the fit); ``sample_weight``: what each state's decision is worth; ``kw`` go
    to the controller (``decision``, ``min_gap``). The scikit-learn tree stays on ``.sklearn_model``; it is never
    saved."""
    from sklearn.tree import DecisionTreeClassifier

    from rift_ada import signals

    X, y = np.array(X, dtype=np.float32), np.asarray(y).astype(int)
    X[:, [signals.index(n) for n in ignore]] = 0.0
    if len(np.unique(y)) < 2:
        raise ValueError("the labels hold a single class: label more states, or change the refresh price")
    model = DecisionTreeClassifier(max_depth=max_depth, min_samples_leaf=min_samples_leaf, random_state=seed)
    model.fit(X, y, sample_weight=sample_weight)
    t = model.tree_
    counts = t.value[:, 0, :]  # per node, class shares (or weighted counts): normalise
    p = counts[:, list(model.classes_).index(1)] / counts.sum(1)
    ctrl = TreeController(feature=tuple(int(f) if f >= 0 else -1 for f in t.feature),
                          threshold=tuple(float(x) for x in t.threshold), left=tuple(int(c) for c in t.children_left),
                          right=tuple(int(c) for c in t.children_right), value=tuple(float(x) for x in p), **kw)
    ctrl.sklearn_model = model
    return ctrl
