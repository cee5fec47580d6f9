"""Comparing refresh controllers with periodic refresh on the AL-versus-refreshes plane.

The periodic curve (never refreshing counts as its zero-refresh point) is made monotone (running max of AL as the
refresh rate grows) and interpolated linearly. For a controller's point (R, AL):
- refresh savings at matched AL: ``1 - R / R_periodic(AL)``, where ``R_periodic(AL)`` is the refresh rate periodic
  refresh needs to reach that AL (None when periodic never reaches it, or reaches it without refreshing);
- AL gain at matched refreshes: ``AL - AL_periodic(R)``.
A family's numbers are those of its best knob setting. With the oracle among the rows (a curve over its refresh
prices), each compared row also gets ``oracle_share``: its refresh savings over the oracle's savings *at the same
AL* (the oracle's refresh rate for that AL read off its own curve, as periodic's is): the share of the saving
possible at that AL it captures; None where the oracle's curve does not reach the AL or saves nothing there.
"""

from __future__ import annotations

import numpy as np

# What the other families are compared with, not compared themselves: periodic refresh (never refreshing is its zero
# point) and the full cache. Every other family (rules, learned controllers, the oracle) is compared.
BASELINES = ("full", "never", "periodic")


def periodic_envelope(rows: list[dict], families=("never", "periodic")) -> tuple[np.ndarray, np.ndarray]:
    """(refresh rates, AL) of the families' points sorted by rate, AL made non-decreasing (never counts as 0)."""
    pts = sorted((0.0 if r["family"] == "never" else r["refreshes_per_1k"], r["acceptance_length"])
                 for r in rows if r["family"] in families)
    if not pts:
        raise ValueError(f"the sweep needs {' or '.join(families)} points to compare against")
    R = np.array([p[0] for p in pts])
    A = np.maximum.accumulate(np.array([p[1] for p in pts]))
    return R, A


def refreshes_needed(al: float, R: np.ndarray, A: np.ndarray) -> float | None:
    if al <= A[0]:
        return float(R[0])
    if al > A[-1]:
        return None
    j = int(np.argmax(A >= al))
    r0, r1, a0, a1 = R[j - 1], R[j], A[j - 1], A[j]
    return float(r1 if a1 == a0 else r0 + (al - a0) * (r1 - r0) / (a1 - a0))


def al_at(refreshes: float, R: np.ndarray, A: np.ndarray) -> float:
    return float(np.interp(refreshes, R, A))


def matched_comparison(rows: list[dict]) -> dict:
    """Annotate the rows of every family but the baselines with ``refresh_savings`` and ``al_gain``; summarise each
    family by its best point."""
    R, A = periodic_envelope(rows)
    families: dict[str, dict] = {}
    for r in rows:
        if r["family"] in BASELINES:
            continue
        need = refreshes_needed(r["acceptance_length"], R, A)
        r["refresh_savings"] = None if not need else 1.0 - r["refreshes_per_1k"] / need
        r["al_gain"] = r["acceptance_length"] - al_at(r["refreshes_per_1k"], R, A)
        fam = families.setdefault(r["family"], {"refresh_savings": None, "al_gain": None,
                                                "savings_knob": None, "gain_knob": None})
        if r["refresh_savings"] is not None and (fam["refresh_savings"] is None
                                                 or r["refresh_savings"] > fam["refresh_savings"]):
            fam["refresh_savings"], fam["savings_knob"] = r["refresh_savings"], r["knob"]
        if fam["al_gain"] is None or r["al_gain"] > fam["al_gain"]:
            fam["al_gain"], fam["gain_knob"] = r["al_gain"], r["knob"]
    curve = periodic_envelope(rows, ("never", "oracle")) if "oracle" in families else None
    for r in rows:
        if r["family"] not in BASELINES:
            r["oracle_share"] = _share(r, curve, R, A)
    for name, fam in families.items():
        shares = [r["oracle_share"] for r in rows if r["family"] == name and r["knob"] == fam["savings_knob"]]
        fam["oracle_share"] = shares[0] if shares else None
    return {"families": families, "periodic_refreshes": R.tolist(), "periodic_al": A.tolist()}


def _share(row: dict, curve, R: np.ndarray, A: np.ndarray) -> float | None:
    """The row's refresh savings over the oracle's at the row's AL (module docstring)."""
    if curve is None or row["refresh_savings"] is None:
        return None
    need = refreshes_needed(row["acceptance_length"], R, A)
    oracle_rate = refreshes_needed(row["acceptance_length"], *curve)
    if not need or oracle_rate is None or oracle_rate >= need:
        return None
    return row["refresh_savings"] / (1.0 - oracle_rate / need)
