"""How well the signals a plain stretch keeps current predict what drafting would gain: over replay tables.

    python experiments/joint_signals.py runs/joint/tables            # every table, grouped by prompt length
    python experiments/joint_signals.py runs/joint/tables --k 11 --stride 3

At every ``--stride``-th position u of each table's continuation: ``target_p`` (the target's mean probability of
the last 8 emitted tokens, ``rift_ada.signals.target_p_mean``), ``match`` (the context's repeated suffix,
``signals.suffix_match``) and what k drafts from there would accept in expectation (the sum of the products of their
acceptance probabilities, from the table's row of the last refresh grid point before u: the draft's cache as a
controller that never refreshed would hold it). Prints, per table group (prompt length, and held-out or training by
file name), each signal's correlation with that count and the mean count per signal bin. docs/joint.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

P_BINS = ((0.0, 0.3), (0.3, 0.6), (0.6, 0.9), (0.9, 1.01))
MATCH_BINS = ((0, 2), (2, 4), (4, 8), (8, 17))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tables", help="a folder of replay tables (*.safetensors), e.g. runs/joint/tables")
    p.add_argument("--k", type=int, default=11, help="draft length whose expected acceptance is predicted")
    p.add_argument("--stride", type=int, default=3, help="every n-th continuation position")
    p.add_argument("--output", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    if args.k < 1 or args.stride < 1:
        p.error("--k and --stride must be >= 1")
    if not Path(args.tables).is_dir():
        p.error(f"{args.tables}: not a folder")
    return args


def points(table, k: int, stride: int) -> np.ndarray:
    """(n, 3): target_p, match, expected accepted drafts of k, at every ``stride``-th position u with a row before it
    and k positions after it."""
    from rift_ada.signals import TARGET_WINDOW, target_p_mean

    acc = np.nan_to_num(table.accept(), nan=0.0)
    matches, out = table.matches(), []
    for u in range(TARGET_WINDOW + 1, len(table.tokens) - k, stride):
        row = (u - 1) // table.grid  # defined from u > row * grid on
        out.append((target_p_mean(table.p, u), matches[u], float(np.cumprod(acc[row, u:u + k]).sum())))
    return np.asarray(out, dtype=np.float64).reshape(-1, 3)


def summarise(x: np.ndarray) -> dict:
    def corr(a, b):
        return float(np.corrcoef(a, b)[0, 1]) if len(a) > 1 and a.std() > 0 and b.std() > 0 else float("nan")

    def binned(col, bins):
        return {f"[{lo}, {hi})": {"n": int(m.sum()), "accepted": float(x[m, 2].mean()) if m.any() else None}
                for lo, hi in bins for m in [(x[:, col] >= lo) & (x[:, col] < hi)]}

    return {"points": len(x), "accepted_mean": float(x[:, 2].mean()) if len(x) else None,
            "corr_target_p": corr(x[:, 0], x[:, 2]), "corr_match": corr(x[:, 1], x[:, 2]),
            "by_target_p": binned(0, P_BINS), "by_match": binned(1, MATCH_BINS)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from rift_ada.replay.table import load_folder

    try:
        tables = load_folder(args.tables, one_decoder=False)  # a study table by table
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    groups: dict = {}
    for t in tables:
        # the nearest whole K: a prompt falls a little short of its target length
        key = f"{'heldout' if Path(t.path).name.startswith('heldout') else 'train'} {round(t.prompt_len / 1024)}K"
        groups.setdefault(key, []).append(points(t, args.k, args.stride))
    report = {key: summarise(np.concatenate(xs)) for key, xs in groups.items()}
    for key, r in report.items():
        print(f"{key}: {r['points']} points, expected accepted of {args.k}: {r['accepted_mean']:.2f}; correlation "
              f"target_p {r['corr_target_p']:.2f}, match {r['corr_match']:.2f}")
        for name in ("by_target_p", "by_match"):
            print(f"  {name}: " + ", ".join(f"{b} {v['accepted']:.2f} (n={v['n']})" for b, v in r[name].items()
                                            if v["n"]))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
