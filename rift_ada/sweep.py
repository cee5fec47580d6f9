"""The refresh tradeoff sweep, shared by experiments/train_controller.py and experiments/reproduce_figures.py (figure 4).

A sweep is a list of :class:`Point`: the full cache first (the reference every AL is divided by), then every
registered controller kind with a knob (``rift_ada.refresh.registry``) at each value of its option (:func:`rule_points`;
:func:`add_knob_options` declares the options), then what the job adds (learned controllers, ``--controller`` files),
then the hindsight oracle at each refresh price (:func:`oracle_points`). A point's counts (:func:`measure`, from an
evaluation or from the oracle's schedules) are what its row of the tradeoff table (:func:`tradeoff_row`) and its
modelled speed (:func:`modelled_speed`) need, so a job can store them and model time later with any costs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from . import distributed, signals
from .refresh.registry import swept


@dataclass(frozen=True)
class Point:
    family: str
    knob: object  # as the table writes it: a knob value, "-", or a controller file's name
    controller: object = None  # what decides (None: never refresh); the oracle's: its refresh price
    unit: str = ""  # its unit in a resumable job's state


def unit_name(family: str, knob, quantile: bool = False) -> str:
    return f"sweep-{family}" + ("" if knob == "-" else f"-q{knob:g}" if quantile else f"-{knob:g}")


def full_point() -> Point:
    return Point("full", "-", None, unit_name("full", "-"))


def oracle_points(lams: Sequence[float]) -> list[Point]:
    return [Point("oracle", lam, lam, unit_name("oracle", lam)) for lam in lams]


# --- the registered kinds' knobs -------------------------------------------------------------------------------------
def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def add_knob_options(group, **defaults) -> None:
    """Declare every swept kind's knob option (``--periods``, ``--acc-thresholds``, ...) on ``group``; ``defaults``
    (by dest, e.g. ``acc_thresholds=[...]``) replace a kind's own."""
    for cls in swept():
        knob = cls.knob
        if knob.option is not None:
            group.add_argument(knob.option, type=knob.type, nargs="+",
                               default=list(defaults.get(_dest(knob.option), knob.default)),
                               help=f"{knob.help} (default: %(default)s)")


def knob_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a knob option's values (one line), or None."""
    for cls in swept():
        if cls.knob.option is not None:
            problem = cls.knob.problem(getattr(args, _dest(cls.knob.option)))
            if problem:
                return problem
    return None


def _values(cls, args) -> list:
    return ["-"] if cls.knob.option is None else list(getattr(args, _dest(cls.knob.option)))


def rule_units(args) -> list[str]:
    """The units of :func:`rule_points`, known before any level is observed."""
    return [unit_name(cls.kind, v, cls.knob.quantiles_of is not None) for cls in swept() for v in _values(cls, args)]


def rule_points(args, observed: np.ndarray) -> list[Point]:
    """Every swept kind at each value of its knob option. A knob given as quantiles of a signal takes the signal's
    levels in ``observed`` (signal vectors, one per row): its points' knob is the level, its units are named by the
    quantile; with no row observed the kind is left out (see :func:`unobserved`)."""
    points = []
    for cls in swept():
        values, quantiles = _values(cls, args), cls.knob.quantiles_of
        if quantiles is None:
            points += [Point(cls.kind, v, cls.at(v), unit_name(cls.kind, v)) for v in values]
            continue
        at = levels(observed, quantiles, values)
        points += [Point(cls.kind, at[q], cls.at(at[q]), unit_name(cls.kind, q, True)) for q in values] if at else []
    return points


def unobserved(observed: np.ndarray) -> list[str]:
    """The swept kinds :func:`rule_points` leaves out for want of observed states."""
    return [cls.kind for cls in swept() if cls.knob.quantiles_of is not None and len(observed) == 0]


def levels(observed: np.ndarray, signal: str, quantiles) -> dict | None:
    """quantile -> the ``signal``'s level at that quantile of the ``observed`` states (4 significant digits: the knob
    written to the table), or None without states."""
    if len(observed) == 0:
        return None
    col = np.asarray(observed)[:, signals.index(signal)].astype(np.float64)
    return {q: min(1.0, float(f"{np.quantile(col, q):.4g}")) for q in quantiles}


# --- running a point -------------------------------------------------------------------------------------------------
def measure(point: Point, decoder, prompts, max_new_tokens: int, oracle_block: int = 4, oracle_beam: int = 2) -> dict:
    """A point's counts on ``prompts``: ``decoder`` (the full cache's for the full point) driven by its controller, or
    the oracle's schedules at its price."""
    from .evaluate import evaluate

    if point.family == "oracle":
        return oracle_counts(run_oracle(decoder, prompts, max_new_tokens, point.controller, oracle_block, oracle_beam))
    return counts(evaluate(decoder, prompts, point.controller, max_new_tokens))


def counts(ev) -> dict:
    """What a point's row and modelled speed need from an evaluation (``rift_ada.evaluate.Evaluation``), not the time
    itself: a stored point stays independent of the costs."""
    s = ev.summary
    return {"acceptance_length": s["acceptance_length"], "refreshes_per_1k": s["refreshes_per_1k_tokens"],
            "refreshes": s["refreshes"], "tokens": s["generated_tokens"],
            "rounds": sum(len(r.rounds) for r in ev.results),
            "drafted": sum(x.draft_length for r in ev.results for x in r.rounds)}


def run_oracle(decoder, prompts, max_new_tokens: int, lam: float, block: int, beam: int) -> list:
    """The hindsight oracle's schedule for every prompt (``rift_ada.oracle``), sharded under torchrun as evaluate()."""
    from .oracle import oracle_schedule

    mine = []
    for i, ids in tqdm(distributed.shard(prompts), desc=f"oracle lambda={lam:g}", leave=False,
                       disable=not distributed.is_main()):
        with distributed.on_shard(i):
            mine.append((i, oracle_schedule(decoder, ids, max_new_tokens, lam, block, beam)))
    return distributed.gather(mine)


def oracle_counts(results) -> dict:
    """:func:`counts` of the oracle's schedules (``rift_ada.oracle.OracleResult``)."""
    tokens = sum(r.tokens for r in results)
    return {"acceptance_length": float(np.mean([r.acceptance_length for r in results])),
            "refreshes_per_1k": 1000 * sum(r.refreshes for r in results) / tokens,
            "refreshes": sum(r.refreshes for r in results), "tokens": tokens,
            "rounds": sum(r.rounds for r in results), "drafted": sum(r.drafted for r in results)}


def tradeoff_row(point: Point, c: dict, full_al: float) -> dict:
    return {"family": point.family, "knob": point.knob, "acceptance_length": c["acceptance_length"],
            "refreshes_per_1k": c["refreshes_per_1k"], "refreshes": c["refreshes"],
            "al_vs_full": c["acceptance_length"] / full_al}


def modelled_speed(c: dict, costs) -> float:
    """Tokens per second modelled with ``costs`` (``rift_ada.costs.CostModel``) from a point's counts."""
    return c["tokens"] / costs.total_seconds(c["drafted"], c["rounds"], c["refreshes"])
