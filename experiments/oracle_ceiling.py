"""How much a refresh controller could save within each task family, and where the oracle's saving comes from.

    python -m rift_ada.replay build --prompts 12 --task low,sort --source-dir setuptools --output-dir runs/ceiling/st-t1
    python experiments/oracle_ceiling.py --tables-dir runs/ceiling/st-t1 --task low,sort

The oracle (``rift_ada.replay.oracle``: the cheapest schedule over a table, knowing the continuation) bounds every
controller: none reaches its AL with fewer expected refreshes. So its refresh savings against periodic refresh at
matched AL, along its curve, are the most a learner can save at each AL, and a bar such as "50% fewer refreshes
than periodic" within a family can only be met where the oracle saves at least that much: there a learner must
capture ``0.5 / oracle saving`` of the oracle's saving. Per family (prompts cycle through ``--task``'s families, as
the table builder made them) and pooled, each with a 95% bootstrap interval over the prompts, it prints:
- the oracle at each ``--lams`` price: AL, refreshes per 1K, savings at matched AL and the share a learner needs;
- ``rate``: each prompt refreshed periodically at its own best period for the same price (a controller that knew
  only how often a prompt needs refreshing, not when): how much of the oracle's saving is the rate, and how much the
  timing within a prompt;
- the signals (as ``rift_ada.signals`` observes them) where the oracle refreshes and where it keeps, at
  ``--label-price`` (the main job's labels' price): what a learner would have to tell apart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from rift_ada.cli import ArgumentParser, check_output, fail, write_output

SIGNALS = ("runway", "focus", "acc_mean", "acc_drop", "acc_fresh", "drift_rise", "entropy_mean")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables-dir", required=True, help="replay tables of one prompt set (python -m rift_ada.replay "
                                                       "build): table-<prompt>-s<seed>.safetensors")
    p.add_argument("--task", default="low,sort,high",
                   help="the families the prompts cycle through, in the order the tables were built with")
    p.add_argument("--periods", type=int, nargs="+", default=[8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256])
    p.add_argument("--lams", type=float, nargs="+", default=[0.5, 1, 2, 4, 8, 16, 32],
                   help="the oracle's refresh prices (target rounds)")
    p.add_argument("--label-price", type=float, default=4.0, help="the price whose decisions the signals are read at")
    p.add_argument("--draft-length", type=int, default=11)
    p.add_argument("--episodes", type=int, default=16, help="replays per table and point (sampling)")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples over the prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write every number here (JSON)")
    args = p.parse_args(argv)
    if min(args.periods) < 1 or min(args.lams) < 0 or args.label_price < 0:
        p.error("--periods must be >= 1 and the prices >= 0")
    for name in ("draft_length", "episodes", "resamples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def load(args):
    """The tables and each one's family (its prompt index in the --task cycle)."""
    from rift_ada.data.tasks import task_mix
    from rift_ada.replay.table import load_folder

    tables = load_folder(args.tables_dir)
    mix = task_mix(args.task)
    if not mix:
        raise ValueError(f"--task {args.task!r} names no family")
    try:
        families = [mix[int(Path(t.path).name.split("-")[1]) % len(mix)] for t in tables]
    except (IndexError, ValueError):
        raise ValueError(f"{args.tables_dir}: tables must be named table-<prompt>-s<seed>.safetensors, as "
                         "python -m rift_ada.replay build names them (the prompt index gives the family)") from None
    return tables, families


def per_prompt_points(tables, args) -> tuple[list, list]:
    """(labels, per-prompt numbers) of never, periodic at each period, the oracle and the rate oracle at each price."""
    from rift_ada.refresh import PeriodicController
    from rift_ada.replay.oracle import oracle_rounds, solve
    from rift_ada.replay.process import table_point, table_replays

    k, ep = args.draft_length, args.episodes
    never = [table_point(r) for r in table_replays(tables, None, k, ep, args.seed)]
    periodic = {n: [table_point(r) for r in table_replays(tables, PeriodicController(n), k, ep, args.seed)]
                for n in args.periods}
    labels, per = [("never", 0)], [never]
    labels += [("periodic", n) for n in args.periods]
    per += list(periodic.values())
    for lam in args.lams:
        labels.append(("oracle", lam))
        per.append([table_point(oracle_rounds(t, solve(t, k, lam), k, ep, args.seed + i))
                    for i, t in enumerate(tables)])
        # each prompt at its own cheapest period for this price (rounds + lam x refreshes), picked on the replays it
        # is scored on: if anything flattering, which only strengthens "the rate explains little"
        labels.append(("rate", lam))
        per.append([min([periodic[n][i] for n in args.periods] + [never[i]],
                        key=lambda c: c["rounds"] + lam * c["refreshes"]) for i in range(len(tables))])
    return labels, per


def signals_at_decisions(tables, args) -> dict:
    """Percentiles (10, 50, 90) of each signal, and of the tokens since the last scoring, where the oracle at
    --label-price refreshes and where it keeps, on its own rollouts (``label_states`` with the oracle as behaviour)."""
    from rift_ada import signals
    from rift_ada.replay.oracle import solve
    from rift_ada.trainers.oracle_labels import label_states

    schedules = [solve(t, args.draft_length, args.label_price) for t in tables]
    by_table = {id(t): s for t, s in zip(tables, schedules)}
    data = label_states(tables, schedules, args.draft_length, lambda rng: lambda r, obs: by_table[id(r.table)].at(
        r.g, r.pending, r.row), 1, np.random.default_rng(args.seed))
    since = np.asarray([signals.tokens_since_refresh(x) for x in data.X], np.float64)
    cols = np.column_stack([since] + [data.X[:, signals.index(n)].astype(np.float64) for n in SIGNALS])
    out = {}
    for key, mask in (("refresh", data.y == 1), ("keep", data.y == 0)):
        x = cols[mask]
        out[key] = {"rounds": int(mask.sum())} | {n: ([float(v) for v in np.percentile(x[:, j], (10, 50, 90))]
                                                     if len(x) else None)
                                                 for j, n in enumerate(("tokens_since_scoring", *SIGNALS))}
    return out


def family_report(labels, per, idx, args) -> dict:
    """The matched comparison over the prompts ``idx``: each oracle / rate point with its interval, and the share of
    the oracle's saving a learner at that AL needs for 50% fewer refreshes than periodic."""
    from rift_ada.tradeoff import bootstrap, matched_comparison, rows_on

    rows = rows_on(labels, per, idx)
    matched = matched_comparison(rows)
    boot = bootstrap(labels, per, prompts=idx, n=args.resamples, seed=args.seed)
    points = []
    for row, ci in zip(rows, boot["rows"]):
        if row["family"] not in ("oracle", "rate"):
            continue
        s = row.get("refresh_savings")
        points.append({**row, "refresh_savings_interval": ci.get("refresh_savings"),
                       "oracle_share_interval": ci.get("oracle_share"),
                       "share_needed_for_half": (0.5 / s if row["family"] == "oracle" and s and s > 0 else None)})
    best = max((p["refresh_savings"] for p in points if p["family"] == "oracle" and p["refresh_savings"] is not None),
               default=None)
    return {"prompts": len(idx), "points": points, "oracle_best_saving": best,
            "periodic": {"refreshes_per_1k": matched["periodic_refreshes"], "al": matched["periodic_al"]}}


def fmt(x, ci=None, pct=True) -> str:
    if x is None:
        return "-"
    s = f"{100 * x:.1f}%" if pct else f"{x:.2f}"
    return s + (f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]" if ci else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_output(args.output)
        tables, families = load(args)
    except (ValueError, OSError) as e:
        return fail(e)
    labels, per = per_prompt_points(tables, args)
    groups = {f: [i for i, x in enumerate(families) if x == f] for f in dict.fromkeys(families)}
    if len(groups) > 1:
        groups["pooled"] = list(range(len(tables)))
    report = {}
    for fam, idx in groups.items():
        rep = family_report(labels, per, idx, args)
        rep["signals"] = signals_at_decisions([tables[i] for i in idx], args)
        report[fam] = rep
        print(f"\n## {fam}: {len(idx)} prompts; the oracle saves at most {fmt(rep['oracle_best_saving'])}")
        print("| point | price | AL | refreshes / 1K | fewer refreshes than periodic | share of the oracle's "
              "| share a learner needs for 50% |")
        print("|---|---|---|---|---|---|---|")
        for p in rep["points"]:
            print(f"| {p['family']} | {p['knob']:g} | {p['acceptance_length']:.2f} | {p['refreshes_per_1k']:.1f} | "
                  f"{fmt(p['refresh_savings'], p['refresh_savings_interval'])} | "
                  f"{fmt(p.get('oracle_share'), p['oracle_share_interval'])} | {fmt(p['share_needed_for_half'])} |")
        for key, s in rep["signals"].items():
            cells = ", ".join(f"{n} {v[1]:.3g} [{v[0]:.3g}, {v[2]:.3g}]" for n, v in s.items() if n != "rounds" and v)
            print(f"oracle {key}s ({s['rounds']} rounds; median [10th, 90th]): {cells}")
    if args.output:
        write_output(args.output, {"tables_dir": str(args.tables_dir), "task": args.task, "lams": args.lams,
                                   "periods": args.periods, "label_price": args.label_price,
                                   "episodes": args.episodes, "families": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
