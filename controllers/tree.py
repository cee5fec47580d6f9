"""The decision-tree controller family: P(refreshing now pays off) from a few thresholds on the signals.

Fitted with scikit-learn (:func:`fit_tree`) to the oracle's decisions over replay tables (:meth:`TreeController.train`,
in the main job); deciding walks the exported nodes with plain Python, so loading and deciding need no scikit-learn. Why a tree beside the logistic model: the states where a refresh pays are a union
of unlike cases (a copy about to run off its selection: short runway, sharp focus; a selection already stale: low
acceptance on copy-like text), which one hyperplane over the signals separates badly, while a depth-3 tree does
(README, the main job's ablation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from rift_ada import signals
from rift_ada.refresh.base import (GapRule, Knob, Option, check_observation, number, read_json, short,
                                   write_controller_file)
from rift_ada.refresh.registry import register

# Signals the tree may not split on: the position in the generation says which training prompt a state came from
# more than anything about the cache.
IGNORED = ("position",)


@register
@dataclass
class TreeController(GapRule):
    """Nodes in scikit-learn's layout: node i tests ``obs[feature[i]] <= threshold[i]`` and goes to ``left[i]``
    (true) or ``right[i]``; a leaf has ``left[i] == -1`` and ``value[i]``, the share of 'refresh' labels there."""

    kind: ClassVar[str] = "tree"
    knob: ClassVar[Knob] = Knob("tree_decisions", float, (), "the tree controller's decision levels swept (default: "
                                "one, chosen on the training tables in replay: the largest saving among levels at "
                                "least as accurate as periodic refresh every 64)", low=0, high=1, open=True,
                                field="decision")
    options: ClassVar[dict] = {"depth": Option(int, 6, "depth of the decision-tree controller", low=1)}
    feature: tuple = ()
    threshold: tuple = ()
    left: tuple = ()
    right: tuple = ()
    value: tuple = ()
    decision: float = 0.5  # refresh when the leaf's P(refresh helps) exceeds this: the knob of the tradeoff curve
    min_gap: int = 0

    def probability(self, observation) -> float:
        obs = check_observation(observation)
        if not self.value:
            raise ValueError("this tree controller is not fitted")
        i = 0
        while self.left[i] != -1:
            i = self.left[i] if float(obs[self.feature[i]]) <= self.threshold[i] else self.right[i]
        return float(self.value[i])

    def fires(self, obs) -> bool:
        return self.probability(obs) > self.decision

    def describe(self) -> str:
        """The tree as indented rules (signal names, thresholds, leaf probabilities)."""
        lines = []

        def walk(i, depth):
            pad = "  " * depth
            if self.left[i] == -1:
                lines.append(f"{pad}P(refresh) = {self.value[i]:.2f}")
                return
            name = signals.NAMES[self.feature[i]]
            lines.append(f"{pad}if {name} <= {self.threshold[i]:.3f}:")
            walk(self.left[i], depth + 1)
            lines.append(f"{pad}else:")
            walk(self.right[i], depth + 1)

        walk(0, 0)
        return "\n".join(lines)

    def save(self, path) -> None:
        write_controller_file(path, {"kind": "tree", "feature": list(self.feature),
                                     "threshold": list(self.threshold), "left": list(self.left),
                                     "right": list(self.right), "value": list(self.value),
                                     "decision": self.decision, "min_gap": self.min_gap})

    @classmethod
    def load(cls, path) -> "TreeController":
        d = read_json(path, "tree")
        fields = {k: d.get(k) for k in ("feature", "threshold", "left", "right", "value")}
        n = len(fields["value"]) if isinstance(fields["value"], list) else -1
        for k, v in fields.items():
            if not isinstance(v, list) or len(v) != n or n < 1:
                raise ValueError(f"{path}: {k!r} must be a list with one entry per node, got {short(v)}")
        children = fields["left"] + fields["right"]
        if (not all(isinstance(c, int) and not isinstance(c, bool) and -1 <= c < n for c in children)
                or not all(isinstance(f, int) and -1 <= f < len(signals.NAMES) for f in fields["feature"])
                or not all(isinstance(x, (int, float)) for x in fields["threshold"] + fields["value"])
                or any((a == -1) != (b == -1) or (a != -1 and (a <= i or b <= i))
                       for i, (a, b) in enumerate(zip(fields["left"], fields["right"])))):
            raise ValueError(f"{path}: not a valid tree (children must be later nodes or -1 at leaves, features "
                             f"signal indices)")
        return cls(**{k: tuple(v) for k, v in fields.items()},
                   decision=number(d, "decision", path, minimum=0, maximum=1),
                   min_gap=number(d, "min_gap", path, integer=True, minimum=0, default=0))

    @classmethod
    def train(cls, job) -> list:
        fitted = job.imitate(cls, lambda X, y, w: fit_tree(X, y, max_depth=job.option(cls, "depth"), min_samples_leaf=50,
                                                           seed=job.args.seed, ignore=IGNORED, sample_weight=w),
                             keep_states=True)
        return [(x, replace(fitted, decision=x)) for x in job.levels(cls, fitted)]


def fit_tree(X: np.ndarray, y: np.ndarray, max_depth: int = 3, min_samples_leaf: int = 10, seed: int = 0,
             ignore: tuple = (), sample_weight=None, **kw) -> TreeController:
    """Fit on signal vectors ``X`` and labels ``y`` (1 = refreshing at that state paid off); ``ignore`` names signals
    no split may use (held constant during the fit); ``sample_weight``: what each state's decision is worth; ``kw`` go
    to the controller (``decision``, ``min_gap``). The scikit-learn tree stays on ``.sklearn_model``; it is never
    saved."""
    from sklearn.tree import DecisionTreeClassifier

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
