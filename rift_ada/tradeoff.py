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
# Periodic refresh whose best AL is within this share of never refreshing's has a flat curve: the refreshes it
# "needs" for an AL between the two are an interpolation across noise (the `high` family, where no refresh helps,
# printed -3195% [-448856, -57]), so savings at matched AL are undefined there, not a number.
FLAT_GAIN = 0.01


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
    flat = bool(A[-1] - A[0] <= FLAT_GAIN * abs(A[0]))
    families: dict[str, dict] = {}
    for r in rows:
        if r["family"] in BASELINES:
            continue
        need = None if flat else refreshes_needed(r["acceptance_length"], R, A)
        r["refresh_savings"] = None if not need else 1.0 - r["refreshes_per_1k"] / need
        r["al_gain"] = r["acceptance_length"] - al_at(r["refreshes_per_1k"], R, A)
        fam = families.setdefault(r["family"], {"refresh_savings": None, "al_gain": None,
                                                "savings_knob": None, "gain_knob": None, "periodic_flat": flat})
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
    return {"families": families, "periodic_refreshes": R.tolist(), "periodic_al": A.tolist(), "periodic_flat": flat}


def _share(row: dict, curve, R: np.ndarray, A: np.ndarray) -> float | None:
    """The row's refresh savings over the oracle's at the row's AL (module docstring)."""
    if curve is None or row["refresh_savings"] is None:
        return None
    need = refreshes_needed(row["acceptance_length"], R, A)
    oracle_rate = refreshes_needed(row["acceptance_length"], *curve)
    if not need or oracle_rate is None or oracle_rate >= need:
        return None
    return row["refresh_savings"] / (1.0 - oracle_rate / need)


# --- intervals over prompts -------------------------------------------------------------------------------------------
def prompt_counts(c: dict) -> list[dict]:
    """A point's numbers per prompt (``per_prompt`` of a sweep unit or a replay; several seeds of a prompt pooled: AL
    their mean, counts summed), in prompt order."""
    per = c.get("per_prompt") or []
    seeds = max([p.get("seed", 0) for p in per], default=0) + 1
    n = len(per) // seeds
    out = []
    for i in range(n):
        mine = [per[s * n + i] for s in range(seeds)]
        row = {"acceptance_length": float(np.mean([p["acceptance_length"] for p in mine]))}
        for key in ("refreshes", "tokens", "rounds", "drafted"):
            if all(key in p for p in mine):
                row[key] = float(sum(p[key] for p in mine))
        out.append(row)
    return out


def rows_on(labels: list[tuple[str, object]], per: list[list[dict]], idx, full_al: float | None = None,
            costs=None) -> list[dict]:
    """Rows of the prompts ``idx`` (indices into each point's ``per`` list, repeats allowed): AL the mean over them,
    refreshes per 1K over their tokens, the modelled tokens/s (with ``costs``) over their modelled time."""
    rows = []
    for (family, knob), p in zip(labels, per):
        sel = [p[i] for i in idx]
        tokens = sum(x["tokens"] for x in sel)
        row = {"family": family, "knob": knob,
               "acceptance_length": float(np.mean([x["acceptance_length"] for x in sel])),
               "refreshes_per_1k": 1000.0 * sum(x["refreshes"] for x in sel) / max(tokens, 1.0),
               "refreshes": float(sum(x["refreshes"] for x in sel))}
        if full_al:
            row["al_vs_full"] = row["acceptance_length"] / full_al
        if costs is not None and all("rounds" in x for x in sel):
            row["modelled_tokens_per_s"] = tokens / costs.total_seconds(sum(x["drafted"] for x in sel),
                                                                      sum(x["rounds"] for x in sel),
                                                                      sum(x["refreshes"] for x in sel))
        rows.append(row)
    return rows


ROW_STATS = ("acceptance_length", "refreshes_per_1k", "al_vs_full", "modelled_tokens_per_s", "refresh_savings",
             "oracle_share", "al_gain")
FAMILY_STATS = ("refresh_savings", "oracle_share", "al_gain")


def bootstrap(labels: list[tuple[str, object]], per: list[list[dict]], full: list[dict] | None = None,
              prompts=None, costs=None, n: int = 1000, seed: int = 0, level: float = 0.95,
              compare: bool = True) -> dict:
    """Percentile intervals from resampling the prompts (``prompts``: the indices to resample, None: all) with
    replacement, ``n`` times: for every row its AL, refresh rate, AL over the full cache's (``full``: the full cache's
    per-prompt numbers), modelled tokens/s and (``compare``) refresh savings, oracle share and AL gain; for every
    compared family (:func:`matched_comparison`, best knob in
    each resample) its refresh savings, oracle share and AL gain. A family statistic undefined in a resample (periodic
    never reaches the AL, ...) is left out of its interval, and ``defined`` says in what share of resamples it was.

    Returns {"rows": [{stat: (lo, hi)}, ...] (in ``labels`` order), "families": {family: {stat: (lo, hi) or None,
    "<stat>_defined": share}}, "prompts": how many were resampled, "resamples": n, "level": level}."""
    idx_all = np.arange(len(per[0])) if prompts is None else np.asarray(list(prompts))
    if len(idx_all) == 0:
        raise ValueError("no prompts to resample")
    rng = np.random.default_rng(seed)
    row_draws = [{s: [] for s in ROW_STATS} for _ in labels]
    fam_draws: dict[str, dict[str, list]] = {}
    for _ in range(n):
        idx = rng.choice(idx_all, size=len(idx_all), replace=True)
        full_al = float(np.mean([full[i]["acceptance_length"] for i in idx])) if full is not None else None
        rows = rows_on(labels, per, idx, full_al, costs)
        if compare:
            for fam, v in matched_comparison(rows)["families"].items():
                d = fam_draws.setdefault(fam, {s: [] for s in FAMILY_STATS})
                for s in FAMILY_STATS:
                    d[s].append(np.nan if v.get(s) is None else v[s])
        for draws, r in zip(row_draws, rows):
            for s in ROW_STATS:
                if s in r:
                    draws[s].append(np.nan if r[s] is None else r[s])
    q = (100 * (1 - level) / 2, 100 * (1 + level) / 2)

    def interval(xs):
        xs = np.asarray(xs, dtype=np.float64)
        xs = xs[~np.isnan(xs)]
        return None if len(xs) == 0 else tuple(float(v) for v in np.percentile(xs, q))

    families = {}
    for fam, d in fam_draws.items():
        families[fam] = {}
        for s in FAMILY_STATS:
            families[fam][s] = interval(d[s])
            families[fam][f"{s}_defined"] = float(np.mean(~np.isnan(np.asarray(d[s], dtype=np.float64))))
    return {"rows": [{s: interval(d[s]) for s in ROW_STATS if d[s]} for d in row_draws], "families": families,
            "prompts": int(len(idx_all)), "resamples": int(n), "level": float(level)}


def compared_with_intervals(labels: list[tuple[str, object]], per: list[list[dict]], full: list[dict] | None = None,
                            prompts=None, n: int = 1000, seed: int = 0) -> dict:
    """Each compared family's matched comparison over ``prompts`` (indices; None: all) with :func:`bootstrap`'s
    intervals: family -> {stat: the point value, "<stat>_interval": (lo, hi) or None, "<stat>_defined": share}."""
    idx = np.arange(len(per[0])) if prompts is None else np.asarray(list(prompts))
    full_al = float(np.mean([full[i]["acceptance_length"] for i in idx])) if full is not None else None
    point = matched_comparison(rows_on(labels, per, idx, full_al))["families"]
    return with_family_intervals({fam: {**{s: v.get(s) for s in FAMILY_STATS}, "periodic_flat": v["periodic_flat"]}
                                  for fam, v in point.items()}, bootstrap(labels, per, full, idx, None, n, seed))


def with_family_intervals(families: dict, boot: dict) -> dict:
    """``families`` (a matched comparison's family summaries: point values) with :func:`bootstrap`'s family
    intervals beside each statistic: "<stat>_interval" (lo, hi) or None, "<stat>_defined" its share of resamples."""
    return {fam: {**v, **{f"{s}_interval": boot["families"].get(fam, {}).get(s) for s in FAMILY_STATS},
                  **{f"{s}_defined": boot["families"].get(fam, {}).get(f"{s}_defined") for s in FAMILY_STATS}}
            for fam, v in families.items()}
