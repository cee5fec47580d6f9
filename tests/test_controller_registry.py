"""A new controller is one class and one registration (rift_ada.refresh.registry): then ``--controller`` parses it,
``load_controller`` loads its file, and both the main job's sweep (experiments/train_controller.py) and figure 4's
(experiments/reproduce_figures.py) take its knob option and include it at each value."""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from rift_ada import signals
from rift_ada.refresh import (Controller, EntropyController, Knob, NeverController, PeriodicController, load_controller,
                              parse_controller, register)
from rift_ada.refresh.base import check_observation, number, read_json, write_controller_file
from rift_ada.refresh.registry import KINDS

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@dataclass
class DriftController(Controller):
    """Refresh when the query drift exceeds ``level``."""

    kind: ClassVar[str] = "toy-drift"
    spelling: ClassVar[str] = "toy-drift:X"
    knob: ClassVar[Knob] = Knob("--toy-drifts", float, (0.2, 0.4), "toy: refresh when drift > x", low=0, high=1)
    level: float = 0.3
    name: str = "toy-drift"

    def decide(self, observation) -> bool:
        return float(check_observation(observation)[signals.index("drift")]) > self.level

    def save(self, path) -> None:
        write_controller_file(path, {"kind": self.kind, "level": self.level})

    @classmethod
    def load(cls, path) -> "DriftController":
        return cls(number(read_json(path, cls.kind), "level", path, minimum=0, maximum=1))


@pytest.fixture
def toy():
    register(DriftController)
    if str(EXPERIMENTS) not in sys.path:  # the scripts import their packages from experiments/
        sys.path.insert(0, str(EXPERIMENTS))
    yield DriftController
    KINDS.pop(DriftController.kind)


def test_a_registered_controller_is_parsed_loaded_and_swept_by_both_jobs(toy, tmp_path):
    import reproduce_figures
    import train_controller
    from controller_job import stages
    from rift_ada import sweep
    from figures import refresh_tradeoff
    from figures.evaluations import EvaluationCache

    assert parse_controller("toy-drift:0.25") == toy(0.25)
    toy(0.35).save(tmp_path / "drift.json")
    assert load_controller(tmp_path / "drift.json") == toy(0.35)
    observed = np.zeros((8, len(signals.NAMES)), dtype=np.float32)  # states to take entropy quantiles from

    # The main job: its option (with the kind's defaults), its units, its points after the other rules.
    assert train_controller.parse_args([]).toy_drifts == [0.2, 0.4]
    args = train_controller.parse_args(["--toy-drifts", "0.1", "0.5", "--learners", "ppo", "--entropy-quantiles", "0.9"])
    assert {"sweep-toy-drift-0.1", "sweep-toy-drift-0.5"} <= set(sweep.rule_units(args))
    points = stages.sweep_points(args, observed, {}, {"tree": [], "logistic": []}, {})
    families = [p.family for p in points]
    assert families.index("toy-drift") > families.index("entropy")
    assert [(p.knob, p.controller, p.unit) for p in points if p.family == "toy-drift"] == [
        (0.1, toy(0.1), "sweep-toy-drift-0.1"), (0.5, toy(0.5), "sweep-toy-drift-0.5")]
    with pytest.raises(SystemExit) as bad:
        train_controller.parse_args(["--toy-drifts", "1.5"])
    assert bad.value.code == 2

    # Figure 4: the same option, its points evaluated on the rift layout with the controller.
    fargs = reproduce_figures.parse_args(["--quick", "--toy-drifts", "0.3"])
    b = EvaluationCache(fargs, None, {}, {}, 1024, 256)
    toys = [p for p in refresh_tradeoff.controller_points(b, observed) if p.family == "toy-drift"]
    assert [(p.knob, p.controller) for p in toys] == [(0.3, toy(0.3))]
    policy = refresh_tradeoff.policy_of(b, toys[0])
    assert policy.name == "rift-ada" and policy.controller == toy(0.3) and policy.layout.refreshable


def test_the_shipped_kinds_and_their_sweep_order():
    from rift_ada import sweep
    from rift_ada.refresh.registry import kinds, swept

    assert kinds() == ["never", "periodic", "threshold", "entropy", "logistic", "tree", "ppo", "dqn"]
    assert kinds(".pt") == ["ppo", "dqn"]
    assert [c.kind for c in swept()] == ["never", "periodic", "threshold", "entropy"]
    assert [parse_controller(s) for s in ("never", "periodic:8", "entropy:0.25")] == [
        NeverController(), PeriodicController(8), EntropyController(0.25)]
    with pytest.raises(ValueError, match="registered already"):
        register(type("Other", (Controller,), {"kind": "never"}))
    args = type("Args", (), {"periods": [16], "acc_thresholds": [0.5], "entropy_quantiles": [0.5]})()
    assert sweep.rule_units(args) == ["sweep-never", "sweep-periodic-16", "sweep-threshold-0.5", "sweep-entropy-q0.5"]
    assert [p.family for p in sweep.rule_points(args, np.zeros((0, len(signals.NAMES))))] == [
        "never", "periodic", "threshold"], "no states observed: the quantile knob's kind is left out"
