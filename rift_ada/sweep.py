"""The refresh tradeoff sweep, shared by experiments/train_controller.py and experiments/reproduce_figures.py (figure 4).

A sweep is a list of :class:`Point`: the full cache first (the reference every AL is divided by), then every
registered rule kind with a knob (``rift_ada.refresh.registry``) at each of its values (:func:`rule_points`; the
command line's spelling of them: ``rift_ada.cli.add_knob_options``), then what the job adds (learned controllers, ``--controller`` files),
then the oracle at each refresh price (:func:`oracle_points`). A point's counts (:func:`measure`, from an evaluation;
the oracle's from replay tables, ``rift_ada.replay.oracle.oracle_counts``) are what its row of the tradeoff table
(:func:`tradeoff_row`) and its modelled speed (:func:`modelled_speed`) need, so a job can store them and model time
later with any costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from . import signals
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


# --- the registered rule kinds' points -------------------------------------------------------------------------------
def rule_units(values: dict) -> list[str]:
    """The units of :func:`rule_points`, known before any level is observed (``values``: kind -> its knob's values,
    as ``rift_ada.cli.knob_values`` reads them from the command line)."""
    return [unit_name(cls.kind, v, cls.knob.quantiles_of is not None) for cls in swept() for v in values[cls.kind]]


def rule_points(values: dict, observed: np.ndarray) -> list[Point]:
    """Every swept rule kind at each of its ``values`` (kind -> list; ``["-"]`` for a kind without values, one
    point). A knob given as quantiles of a signal takes the signal's levels in ``observed`` (signal vectors, one per
    row): its points' knob is the level, its units are named by the quantile; with no row observed the kind is left
    out (see :func:`unobserved`)."""
    points = []
    for cls in swept():
        quantiles = cls.knob.quantiles_of
        if quantiles is None:
            points += [Point(cls.kind, v, cls.at(v), unit_name(cls.kind, v)) for v in values[cls.kind]]
            continue
        at = levels(observed, quantiles, values[cls.kind])
        points += ([Point(cls.kind, at[q], cls.at(at[q]), unit_name(cls.kind, q, True)) for q in values[cls.kind]]
                   if at else [])
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
def measure(point: Point, decoder, prompts, max_new_tokens: int, seeds: int = 1) -> dict:
    """A point's counts on ``prompts``: ``decoder`` (the full cache's for the full point) driven by its controller;
    with ``seeds`` > 1 (sampling), once per decoder seed (``decoder.seed`` + 0, 1, ...), merged by
    :func:`merge_seeds`. (The oracle's points come from replay tables: ``rift_ada.replay.oracle.oracle_counts``.)"""
    from .evaluate import evaluate

    base, runs = decoder.seed, []
    try:
        for s in range(seeds):
            decoder.seed = base + s
            runs.append(counts(evaluate(decoder, prompts, point.controller, max_new_tokens)))
    finally:
        decoder.seed = base
    return merge_seeds(runs)


def merge_seeds(runs: list[dict]) -> dict:
    """One point's counts over several seeds: AL the mean of the seeds' ALs, refreshes per 1K over all tokens, counts
    summed, each prompt's own numbers listed (``per_prompt``, with its seed), and the spread (``al_std``,
    ``refreshes_per_1k_std``: standard deviation over seeds, 0 for one seed)."""
    if len(runs) == 1:
        return {**runs[0], "al_std": 0.0, "refreshes_per_1k_std": 0.0,
                "per_prompt": [{**p, "seed": 0} for p in runs[0].get("per_prompt", [])]}
    out = {k: sum(r[k] for r in runs) for k in ("refreshes", "tokens", "rounds", "drafted")}
    out["per_prompt"] = [{**p, "seed": s} for s, r in enumerate(runs) for p in r.get("per_prompt", [])]
    out["acceptance_length"] = float(np.mean([r["acceptance_length"] for r in runs]))
    out["refreshes_per_1k"] = 1000 * out["refreshes"] / out["tokens"]
    out["al_std"] = float(np.std([r["acceptance_length"] for r in runs]))
    out["refreshes_per_1k_std"] = float(np.std([r["refreshes_per_1k"] for r in runs]))
    return out


def counts(ev) -> dict:
    """What a point's row and modelled speed need from an evaluation (``rift_ada.evaluate.Evaluation``), not the time
    itself: a stored point stays independent of the costs."""
    s = ev.summary
    return {"acceptance_length": s["acceptance_length"], "refreshes_per_1k": s["refreshes_per_1k_tokens"],
            "refreshes": s["refreshes"], "tokens": s["generated_tokens"],
            "rounds": sum(len(r.rounds) for r in ev.results),
            "drafted": sum(x.draft_length for r in ev.results for x in r.rounds),
            "per_prompt": [{"acceptance_length": row["acceptance_length"], "refreshes": row["refreshes"],
                            "tokens": row["generated_tokens"]} for row in ev.rows]}


def family_rows(points: Sequence[Point], counts: Sequence[dict], families: Sequence[str]) -> dict[str, list[dict]]:
    """Per task family (prompt i belongs to ``families[i % len(families)]``, as ``build_task_mix`` cycles them), the
    rows :func:`tradeoff_row` would give on that family's prompts alone (AL: mean over its prompts and seeds)."""
    out = {}
    for f, fam in enumerate(families):
        rows, full = [], None
        for pt, c in zip(points, counts):
            mine = [p for (i, _), p in _by_prompt(c).items() if i % len(families) == f]
            if not mine:
                continue
            tokens = sum(p["tokens"] for p in mine)
            row = {"family": pt.family, "knob": pt.knob,
                   "acceptance_length": float(np.mean([p["acceptance_length"] for p in mine])),
                   "refreshes_per_1k": 1000 * sum(p["refreshes"] for p in mine) / max(tokens, 1),
                   "refreshes": sum(p["refreshes"] for p in mine)}
            if pt.family == "full":
                full = row["acceptance_length"]
            else:
                rows.append(row)
        for r in rows:
            r["al_vs_full"] = r["acceptance_length"] / full if full else None
        if rows:  # fewer prompts than families: some have none
            out[fam] = rows
    return out


def _by_prompt(c: dict) -> dict:
    """(prompt index, seed) -> that prompt's numbers, in the order :func:`merge_seeds` lists them."""
    seeds = max([p.get("seed", 0) for p in c.get("per_prompt", [])], default=0) + 1
    n = len(c.get("per_prompt", [])) // seeds
    return {(i % n, p.get("seed", 0)): p for i, p in enumerate(c.get("per_prompt", []))}


def tradeoff_row(point: Point, c: dict, full_al: float) -> dict:
    return {"family": point.family, "knob": point.knob, "acceptance_length": c["acceptance_length"],
            "al_std": c.get("al_std", 0.0), "refreshes_per_1k": c["refreshes_per_1k"],
            "refreshes_per_1k_std": c.get("refreshes_per_1k_std", 0.0), "refreshes": c["refreshes"],
            "al_vs_full": c["acceptance_length"] / full_al}


def modelled_speed(c: dict, costs) -> float:
    """Tokens per second modelled with ``costs`` (``rift_ada.costs.CostModel``) from a point's counts."""
    return c["tokens"] / costs.total_seconds(c["drafted"], c["rounds"], c["refreshes"])
