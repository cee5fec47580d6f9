"""Figure 4: the refresh tradeoff. AL and tokens/s (measured, and modelled from the costs measured once) versus
refreshes per 1K tokens for the sweep train_controller.py draws (``rift_ada.sweep``): every registered controller kind
at each value of its knob option (never = rift-stat, periodic = rift-dyn, the threshold and entropy rules, ...; a knob
of quantiles at the levels seen in the rift-stat run), every --controller given, and the oracle at each of
--oracle-lams (the best schedule over replay tables of the main prompts, ``rift_ada.replay``); the % fewer refreshes
than periodic at matched AL comes from rift_ada.tradeoff."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from rift_ada import signals, sweep
from rift_ada.replay.oracle import oracle_counts
from rift_ada.sweep import Point

from .figure import Figure, fmt, pct

COLUMNS = ["family", "knob", "acceptance_length", "al_vs_full", "refreshes_per_1k", "refreshes", "tokens_per_second",
           "modelled_tokens_per_second", "refresh_savings", "al_gain"]


def figure(b) -> Figure:
    from rift_ada.tradeoff import matched_comparison

    points = controller_points(b, entropy_observations(b))
    evs = [b.evaluate(policy_of(b, p), label=f"fig4 {p.family} {p.knob}") for p in points]
    full = evs[0].summary["acceptance_length"]
    rows = [row(b, p, sweep.counts(ev), full, ev.summary["tokens_per_second"]) for p, ev in zip(points, evs)]
    tables = oracle_tables(b) if b.args.oracle_lams else []
    for p in sweep.oracle_points(b.args.oracle_lams):  # no measured speed: replayed
        rows.append(row(b, p, oracle_counts(tables, b.args.draft_length, p.controller, seed=b.args.seed), full, None))
    summary = matched_comparison(rows[1:])  # adds refresh_savings / al_gain to the compared rows
    return Figure("fig4_refresh_tradeoff", "The refresh tradeoff", COLUMNS, rows, table(b, rows, summary),
                  lambda fig: draw(fig, b, rows), wide=True)


def entropy_observations(b) -> np.ndarray:
    """Signal vectors of the rift-stat run's rounds, with their draft entropy (the quantile knobs' levels)."""
    never = b.evaluate(b.policy("rift-stat"), label="fig4 never")  # rift-stat = the rift layout, never refreshed
    ent = np.array([x.entropy_mean for r in never.results for x in r.rounds], dtype=np.float64)
    ent /= math.log(b.pair.target.config.vocab_size)  # the entropy_mean signal's unit
    X = np.zeros((len(ent), len(signals.NAMES)), dtype=np.float32)
    X[:, signals.index("entropy_mean")] = ent
    return X


def controller_points(b, observed: np.ndarray) -> list[Point]:
    """The full cache, every swept kind at each knob value (each setting once), then every --controller."""
    from rift_ada.cli import knob_values
    from rift_ada.refresh import parse_controller

    points = [sweep.full_point()]
    for p in sweep.rule_points(knob_values(b.args), observed):
        if all((q.family, q.knob) != (p.family, p.knob) for q in points):
            points.append(p)
    for spec in b.args.controllers:
        ctrl = b.rift_ada_controller() if spec == b.args.controllers[0] else parse_controller(spec)
        points.append(Point(ctrl.kind, Path(spec).name, ctrl))
    return points


def policy_of(b, p: Point):
    """The full cache, rift-stat for never refreshing (the setting of figures 1-3), else rift with the controller."""
    if p.family in ("full", "never"):
        return b.policy("full" if p.family == "full" else "rift-stat")
    return b.policy("rift-ada", controller=p.controller)


def row(b, p: Point, c: dict, full: float, measured: float | None) -> dict:
    modelled = None if p.family == "full" or b.costs is None else sweep.modelled_speed(c, b.costs)
    return {**sweep.tradeoff_row(p, c, full), "tokens_per_second": measured, "modelled_tokens_per_second": modelled,
            "refresh_savings": None, "al_gain": None}


def oracle_tables(b) -> list:
    """Replay tables of the main prompts under the rift-dyn layout (in <output-dir>/tables; reused when there)."""
    from pathlib import Path

    from rift_ada.cli import decoding_from_args
    from rift_ada.replay import ReplayTable
    from rift_ada.replay.build import Builder, TableSpec, build_tables

    a = b.args
    layout = b.policy("rift-dyn").layout
    builder = Builder(a.target, a.drafter, layout, decoding_from_args(a, draft_step="model", verify_step="model"),
                      a.max_new_tokens, a.device, a.dtype, a.threads)
    specs = [TableSpec(f"fig4-{i:03d}", tuple(ids), a.seed) for i, ids in enumerate(b.prompts["main"])]
    paths = build_tables(builder, specs, Path(a.output_dir) / "tables", b.pair, progress="fig4 oracle tables")
    return [ReplayTable.load(p) for p in paths]


def table(b, rows: list, summary: dict) -> str:
    lines = ["| family | knob | AL | AL / full | refreshes per 1K | tok/s measured | tok/s modelled | "
             "fewer refreshes than periodic at matched AL |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['knob'] if isinstance(r['knob'], str) else format(r['knob'], 'g')} | "
              f"{r['acceptance_length']:.3f} | {r['al_vs_full']:.3f} | {r['refreshes_per_1k']:.2f} | "
              f"{fmt(r['tokens_per_second'], '.1f')} | {fmt(r['modelled_tokens_per_second'], '.1f')} | "
              f"{'-' if r['refresh_savings'] is None else format(100 * r['refresh_savings'], '.1f') + '%'} |"
              for r in rows]
    if b.costs is not None:
        lines.append(f"\nModelled tokens/s (rift_ada.costs, measured once): draft step {1e3 * b.costs.draft_step_s:.2f}"
                     f" ms, verify {1e3 * b.costs.verify_s:.2f} ms, refresh {1e3 * b.costs.refresh_s:.2f} ms.")
    for fam, s in summary["families"].items():
        sav = ("undefined (periodic refresh gains no AL here)" if s.get("periodic_flat") else
               "n/a" if s["refresh_savings"] is None else f"{100 * s['refresh_savings']:.1f}%")
        lines.append(f"\n{fam}: {sav} fewer refreshes than periodic refresh at matched AL (best knob)")
    return "\n".join(lines)


def draw(fig, b, rows: list) -> None:
    families = list(dict.fromkeys(r["family"] for r in rows[1:]))
    axes = fig.subplots(1, 3)
    for ax, key, ylabel in zip(axes, ("acceptance_length", "tokens_per_second", "modelled_tokens_per_second"),
                               ("acceptance length", "tokens / s (measured)", "tokens / s (modelled)")):
        for fam in families:
            pts = sorted((r["refreshes_per_1k"], r[key]) for r in rows[1:] if r["family"] == fam and r[key] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=fam)
        if rows[0][key] is not None:
            ax.axhline(rows[0][key], color="grey", ls="--", label="full cache")
        ax.set_xlabel("refreshes per 1K generated tokens")
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Refresh tradeoff, budget {pct(b.budget, b.input_size)}", fontsize=9)
