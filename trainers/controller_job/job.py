"""What a learned controller kind trains on in the main job, and the units it trains in.

A learned kind (``rift_ada.refresh.base.Controller`` with a ``train`` classmethod, one file in ``rift_ada.controllers``)
receives a :class:`Job` and returns its sweep points. The three ways the shipped kinds learn are methods here, each a
resumable unit of the job's state (``rift_ada.resume.RunState``), so a kind's file says only what is its own (how to
fit, how to export): imitation of the oracle (:meth:`Job.imitate`, then :meth:`Job.levels` for its decision level),
and reinforcement learning in the replay environment (:meth:`Job.reinforce`, once per refresh-cost weight).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

# The decision levels tried on the training tables when --KIND-LEVELS is not given.
LEVEL_CANDIDATES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@dataclass
class Job:
    """The training side of one main job: its state, W&B run, settings, training tables and measured costs."""

    state: object  # rift_ada.resume.RunState
    run: object  # rift_ada.trainers.wandb_logging.ResumableRun
    args: object  # the parsed options of experiments/train_controller.py
    tables: list  # the training tables (rift_ada.replay.ReplayTable)
    costs: object  # rift_ada.costs.CostModel
    states: np.ndarray | None = None  # the first imitating kind's labelled states: the levels quantile knobs take
    _schedules: list | None = field(default=None, repr=False)

    def option(self, cls, name: str):
        """A kind's training option ``--KIND-NAME`` (``Controller.options``)."""
        from rift_ada.cli import option_dest

        return getattr(self.args, option_dest(cls, name))

    def values(self, cls) -> list:
        """The values of a kind's knob given on the command line (``rift_ada.cli.add_learned_options``)."""
        return list(getattr(self.args, cls.knob.name))

    def oracle(self) -> list:
        """The oracle's schedules over the training tables at --label-price (solved once, shared by the kinds)."""
        from rift_ada.replay.oracle import solve

        if self._schedules is None:
            self._schedules = [solve(t, self.args.draft_length, self.args.label_price) for t in self.tables]
        return self._schedules

    def imitate(self, cls, fit: Callable, keep_states: bool = False):
        """``cls`` fitted by ``fit(X, y, weight)`` to the oracle's decisions (DAgger rounds on the training tables,
        ``rift_ada.trainers.oracle_labels.imitate``): a unit named after the kind, its controller file beside it.
        ``keep_states``: store the labelled states (the job's :attr:`states`, unless a kind before kept them)."""
        from rift_ada.resume import atomic_write
        from rift_ada.trainers.oracle_labels import imitate

        a = self.args
        path = self.state.path(f"{cls.kind}-fitted{cls.suffix}")

        def compute():
            res = imitate(self.tables, fit, a.draft_length, a.label_price, a.dagger_rounds, a.label_episodes,
                          tuple(a.behaviour_periods), seed=a.seed, schedules=self.oracle())
            for h in res.history:
                self.run.log({f"{cls.kind}/dagger/{k}": v for k, v in h.items()})
            ctrl = res.controller
            acc = float((np.asarray([ctrl.decide(x) for x in res.data.X]) == res.data.y).mean())
            self.run.log({f"{cls.kind}/train_accuracy": acc, f"{cls.kind}/states": len(res.data.y)})
            atomic_write(path, ctrl.save)  # before the unit's JSON
            data = {"X": res.data.X.tolist()} if keep_states else {}
            rules = {"rules": ctrl.describe()} if hasattr(ctrl, "describe") else {}  # a tree's, readable
            return {"history": res.history, "train_accuracy": acc, **rules, **data}

        unit = self.state.unit(cls.kind, compute)
        if "X" in unit and self.states is None:
            self.states = np.asarray(unit["X"], dtype=np.float32)
        return cls.load(path)  # the same controller, resumed or not

    def levels(self, cls, fitted) -> list:
        """The decision levels (``cls.knob.field``) swept: those given, else one chosen on the *training* tables
        (replay; a unit): the candidate with the largest refresh savings against periodic refresh at matched AL among
        those at least as accurate as periodic refresh every 64 tokens (an operating point at high AL: the best
        overall is often at low AL, where periodic refresh pays least), or the best overall where none is."""
        from rift_ada.refresh import PeriodicController
        from rift_ada.replay.process import replay_counts
        from rift_ada.tradeoff import matched_comparison

        given = self.values(cls)
        if given:
            return given
        k, eps, seed, tables = self.args.draft_length, 4, self.args.seed, self.tables

        def compute():
            rows = [{"family": "never", "knob": "-", **replay_counts(tables, None, k, eps, seed)}]
            rows += [{"family": "periodic", "knob": n, **replay_counts(tables, PeriodicController(n), k, eps, seed)}
                     for n in (8, 16, 24, 32, 48, 64, 96)]
            rows += [{"family": cls.kind, "knob": x, **replay_counts(
                tables, replace(fitted, **{cls.knob.field: x}), k, eps, seed)} for x in LEVEL_CANDIDATES]
            summary = matched_comparison(rows)["families"]
            high = next(r["acceptance_length"] for r in rows if r["family"] == "periodic" and r["knob"] == 64)
            mine = [r for r in rows if r["family"] == cls.kind]
            self.run.log({f"{cls.kind}/train_replay_savings": summary.get(cls.kind, {}).get("refresh_savings")})
            return {"chosen": _best([r for r in mine if r["acceptance_length"] >= high]) or _best(mine),
                    "rows": [{k2: v for k2, v in r.items() if k2 != "per_prompt"} for r in rows]}

        return self.state.unit(f"knobs-{cls.kind}", compute)["chosen"]

    def reinforce(self, cls, lam: float, learn: Callable, export: Callable, timesteps: int, **settings):
        """``cls`` trained by ``learn(env_fns, timesteps, ...)`` (a stable-baselines3 learner of
        ``rift_ada.trainers``) in the replay environment over the training tables at refresh-cost weight ``lam``,
        the reward shaped by the oracle's cost to go unless --no-shaping; ``export(model, venv, lam)`` makes the
        controller. A unit named ``KIND-lamLAM``, its controller file beside it."""
        name = f"{cls.kind}-lam{lam:g}"
        self.state.unit(name, lambda: self._reinforce(cls, lam, learn, export, timesteps, name, settings))
        return cls.load(self.state.path(f"{name}{cls.suffix}"))  # the same weights, resumed or not

    def env(self, lam: float) -> dict:
        """The replay environment's settings at refresh-cost weight ``lam``."""
        a = self.args
        return dict(draft_length=a.draft_length, lam=lam, refresh_cost=a.refresh_cost, reward=a.reward,
                    costs=self.costs, shaping=a.shaping)

    def _reinforce(self, cls, lam, learn, export, timesteps, name, settings) -> dict:
        from rift_ada.envs import ReplayEnv
        from rift_ada.resume import atomic_write
        from rift_ada.trainers.wandb_logging import sb3_logger

        env = self.env(lam)
        env_fns = [lambda: ReplayEnv(self.tables, **env) for _ in range(self.args.n_envs)]
        prefix = f"{cls.kind}_lam{lam:g}"
        self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/timesteps")
        model, venv = learn(env_fns, timesteps, seed=self.args.seed, logger=sb3_logger(self.run.log, prefix),
                            progress=f"{cls.kind.upper()} lambda={lam:g}", **settings)
        venv.close()
        atomic_write(self.state.path(f"{name}{cls.suffix}"), export(model, venv, lam).save)  # before the unit's JSON
        return {"lam": lam}


def _best(rows: list[dict]) -> list:
    ranked = sorted(rows, key=lambda r: (r["refresh_savings"] is not None, r["refresh_savings"] or 0.0,
                                         r["acceptance_length"]))
    return [ranked[-1]["knob"]] if ranked else []
