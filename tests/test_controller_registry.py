"""A new controller is one class and one registration (rift_ada.refresh.registry): then ``--controller`` parses it,
``load_controller`` loads its file, and both the main job's sweep (experiments/train_controller.py) and figure 4's
(experiments/reproduce_figures.py) take its knob option and include it at each value. A learned kind (one with a
``train``) is also trained by the main job, with its options on its command line, and exported."""

import csv
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from rift_ada import signals
import torch

from rift_ada.refresh import (Controller, EntropyController, Knob, NeverController, Option, PeriodicController,
                              load_controller, parse_controller, register)
from rift_ada.refresh.base import check_observation, number, read_json, write_controller_file
from rift_ada.refresh.registry import KINDS

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class DriftController(Controller):
    """Refresh when the query drift exceeds ``level``."""

    kind: ClassVar[str] = "toy-drift"
    spelling: ClassVar[str] = "toy-drift:X"
    knob: ClassVar[Knob] = Knob("toy_drifts", float, (0.2, 0.4), "toy: refresh when drift > x", low=0, high=1)
    level: float = 0.3

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
    yield DriftController
    KINDS.pop(DriftController.kind)


def test_a_registered_controller_is_parsed_loaded_and_swept_by_both_jobs(toy, tmp_path):
    from rift_ada import sweep
    from rift_ada.cli import knob_values
    from rift_ada.studies.figures import refresh_tradeoff
    from rift_ada.studies.figures.evaluations import EvaluationCache
    from rift_ada.trainers.controller_job import stages
    from tests.conftest import script_module

    reproduce_figures, train_controller = script_module("reproduce_figures"), script_module("train_controller")
    assert parse_controller("toy-drift:0.25") == toy(0.25)
    toy(0.35).save(tmp_path / "drift.json")
    assert load_controller(tmp_path / "drift.json") == toy(0.35)
    observed = np.zeros((8, len(signals.NAMES)), dtype=np.float32)  # states to take entropy quantiles from

    # The main job: its option (with the kind's defaults), its units, its points after the other rules.
    assert train_controller.parse_args([]).toy_drifts == [0.2, 0.4]
    args = train_controller.parse_args(["--toy-drifts", "0.1", "0.5", "--learners", "ppo", "--entropy-quantiles", "0.9"])
    values = knob_values(args)
    assert {"sweep-toy-drift-0.1", "sweep-toy-drift-0.5"} <= set(sweep.rule_units(values))
    points = stages.sweep_points(values, observed, {})
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


@dataclass
class BiasController(Controller):
    """A learned toy: refresh when the drift exceeds ``level``, where training sets ``level`` to the median drift of
    the oracle's refresh states on the training tables, the knob scales it."""

    kind: ClassVar[str] = "toy-learned"
    knob: ClassVar[Knob] = Knob("toy_scales", float, (1.0,), "toy: multiples of the learned level", low=0,
                                field="scale")
    options: ClassVar[dict] = {"quantile": Option(float, 0.5, "toy: the quantile of the refresh states' drift",
                                                  low=0)}
    optional: ClassVar[bool] = True
    level: float = 0.5
    scale: float = 1.0

    def decide(self, observation) -> bool:
        return float(check_observation(observation)[signals.index("drift")]) > self.level * self.scale

    def save(self, path) -> None:
        write_controller_file(path, {"kind": self.kind, "level": self.level, "scale": self.scale})

    @classmethod
    def load(cls, path) -> "BiasController":
        d = read_json(path, cls.kind)
        return cls(number(d, "level", path), number(d, "scale", path))

    @classmethod
    def train(cls, job) -> list:
        def fit(X, y, w):
            drift = X[y == 1, signals.index("drift")]
            return cls(float(np.quantile(drift, job.option(cls, "quantile"))) if len(drift) else 1.0)

        fitted = job.imitate(cls, fit)
        return [(x, replace(fitted, scale=x)) for x in job.values(cls)]


@pytest.fixture
def toy_learned():
    register(BiasController)
    yield BiasController
    KINDS.pop(BiasController.kind)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_registered_learned_family_is_trained_swept_exported_and_loaded(toy_learned, tmp_path):
    """One file and one registration: the main job trains it (its options and knob on the command line), sweeps it,
    exports it; ``--controller`` (evaluate) and ``rift_generate`` load its file."""
    from rift_ada.evaluate import build_parser, run
    from tests.conftest import script_module

    train_controller = script_module("train_controller")
    out = tmp_path / "job"
    argv = ["--learners", "toy-learned", "--toy-scales", "1", "2", "--toy-learned-quantile", "0.25",
            "--train-sources", "stdlib", "--prompts-per-source", "1", "--eval-prompts", "1", "--input-tokens", "1024",
            "--max-new-tokens", "64", "--train-new-tokens", "64", "--budget", "128", "--task", "low",
            "--dagger-rounds", "1", "--label-episodes", "1", "--oracle-lams", "--oracle-episodes", "1",
            "--tree-depth", "2", "--tree-decisions", "0.5", "--logistic-thresholds", "0.5", "--periods", "32",
            "--workers", "1", "--wandb-mode", "disabled", "--output-dir", str(out),
            "--target", "testbed-lm", "--drafter", "testbed-lm"]  # the trained pair: the registry's path, no copier
    assert train_controller.parse_args(argv).toy_learned_quantile == 0.25
    with pytest.raises(SystemExit):
        train_controller.parse_args(argv + ["--toy-learned-quantile", "-1"])
    assert train_controller.main(argv) == 0
    rows = list(csv.DictReader(open(out / "tradeoff.csv")))
    assert [float(r["knob"]) for r in rows if r["family"] == "toy-learned"] == [1.0, 2.0]
    exported = out / "controller-toy-learned.json"
    ctrl = load_controller(exported)
    assert isinstance(ctrl, BiasController) and ctrl.level > 0
    common = ["--budget", "128", "--prompts", "1", "--input-tokens", "1024", "--max-new-tokens", "32", "--json",
              "--task", "low"]
    assert run(build_parser().parse_args(["--policy", "rift-ada", "--controller", str(exported), *common]))[
        "acceptance_length"] > 0

    from rift_ada.hf import rift_generate
    from rift_ada.models import load_pair

    pair = load_pair("testbed", "testbed")
    ids = torch.randint(5, 200, (1, 256), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    mine = pair.target.generate(ids, assistant_model=pair.draft, custom_generate=rift_generate, rift_policy="rift-ada",
                                rift_budget=64, rift_controller=str(exported), **kw)
    assert torch.equal(mine, pair.target.generate(ids, **kw)), "greedy: the target's own output"
    assert parse_controller(str(exported)) == ctrl


def test_the_shipped_kinds_and_their_sweep_order():
    from rift_ada import sweep
    from rift_ada.refresh.registry import kinds, swept

    assert kinds() == ["never", "periodic", "threshold", "entropy", "tree", "logistic", "ppo", "dqn"]
    assert kinds(".pt") == ["ppo", "dqn"]
    assert [c.kind for c in swept()] == ["never", "periodic", "threshold", "entropy"]
    assert [parse_controller(s) for s in ("never", "periodic:8", "entropy:0.25")] == [
        NeverController(), PeriodicController(8), EntropyController(0.25)]
    with pytest.raises(ValueError, match="registered already"):
        register(type("Other", (Controller,), {"kind": "never"}))
    args = {"never": ["-"], "periodic": [16], "threshold": [0.5], "entropy": [0.5]}
    assert sweep.rule_units(args) == ["sweep-never", "sweep-periodic-16", "sweep-threshold-0.5", "sweep-entropy-q0.5"]
    assert [p.family for p in sweep.rule_points(args, np.zeros((0, len(signals.NAMES))))] == [
        "never", "periodic", "threshold"], "no states observed: the quantile knob's kind is left out"
