"""Which signals carry across code bases: the main job's tree refitted with groups of signals hidden, each judged on
the code bases it trained on, on each training code base left out in turn, and on the held-out code base, in replay.

    python experiments/controller_ablation.py --run runs/controller      # about 15 minutes: replay only

Takes the replay tables a finished (or resumed) main job built (``<run>/tables``: ``train-*`` from its training
code bases, ``heldout-*`` from its held-out one; ``--heldout-tables DIR`` replaces the latter), refits the tree on
the oracle's decisions (the job's recipe: ``rift_ada.trainers.oracle_labels.imitate``) per variant, and replays each
variant and periodic refresh:

- ``train``: fitted on every training table, replayed on them (what it learned);
- ``cv``: leave one code base out: fitted on the others' tables, replayed on its own, pooled over the code bases
  (whether it carries to code it never saw, measured without the held-out code base: the one to decide with);
- ``heldout``: fitted on every training table, replayed on the held-out code base's tables (the report).

A hidden signal is a constant column during the fit, so no split can use it. Per variant and column it reports the
refresh savings against periodic at matched AL (best decision level) and the AL and refreshes per 1K there.
Writes ``<out>/ablation.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from rift_ada.cli import ArgumentParser, fail
from rift_ada.data.sources import mix_sources

# Variant name -> the signals it hides.
GROUPS = {
    "all signals": (),
    "no drift (raw)": ("drift",),
    "no drift at all": ("drift", "drift_rise"),
    "no read-ahead": ("runway", "focus"),
    "no entropy": ("entropy_mean", "entropy_max"),
    "no relative signals": ("acc_fresh", "acc_drop", "drift_rise"),
    "relative only": ("drift", "entropy_mean", "entropy_max", "acc_1", "acc_2", "acc_3", "acc_4", "acc_mean"),
    "no position": ("position",),
}


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/controller", help="a main job's --output-dir")
    p.add_argument("--heldout-tables", default=None, help="a folder of held-out tables (instead of <run>'s)")
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("--decisions", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5, 0.6])
    p.add_argument("--periods", type=int, nargs="+", default=[16, 24, 32, 48, 64, 96, 128])
    p.add_argument("--episodes", type=int, default=8, help="replays per table and point (sampling)")
    p.add_argument("--variants", nargs="*", default=list(GROUPS), help=f"of: {', '.join(GROUPS)}")
    args = p.parse_args(argv)
    try:
        from rift_ada.replay.table import job_tables, load_folder

        opts, train, heldout = job_tables(args.run)
        if args.heldout_tables:
            heldout = load_folder(args.heldout_tables)
        if not heldout:
            raise FileNotFoundError(f"no held-out tables in {args.heldout_tables or args.run}")
        unknown = [v for v in args.variants if v not in GROUPS]
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown}; choose among {list(GROUPS)}")
    except (FileNotFoundError, ValueError, OSError) as e:
        return fail(e)
    results = ablate(train, heldout, opts, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps({"options": vars(args), "results": results}, indent=1))
    print(f"\n{len(train)} training tables, {len(heldout)} held-out tables; refresh savings vs periodic at matched AL "
          "(best level) and the tree's AL / refreshes per 1K there")
    print("| variant | training code bases | each left out (cv) | held-out code base |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {cell(r['train'])} | {cell(r['cv'])} | {cell(r['heldout'])} |")
    return 0


def cell(r: dict) -> str:
    best = r["best"]
    if best is None:
        return "no saving"
    return f"{100 * best['refresh_savings']:.1f}% (AL {best['acceptance_length']:.2f} at {best['refreshes_per_1k']:.1f})"


def ablate(train, heldout, opts, args) -> dict:
    from dataclasses import replace

    from rift_ada import signals
    from rift_ada.controllers import fit_tree
    from rift_ada.refresh import PeriodicController
    from rift_ada.replay.oracle import solve
    from rift_ada.replay.process import merge_tables, replay_counts
    from rift_ada.tradeoff import matched_comparison
    from rift_ada.trainers.oracle_labels import imitate

    k, price = opts.get("draft_length", 11), opts.get("label_price", 4.0)
    source = mix_sources(str(opts.get("train_sources", "x")), len(train))
    sources = max(source) + 1
    schedules = [solve(t, k, price) for t in train]
    baseline = {name: [{"family": "periodic", "knob": n, **replay_counts(tabs, PeriodicController(n), k, args.episodes)}
                       for n in args.periods] + [{"family": "never", "knob": "-",
                                                  **replay_counts(tabs, None, k, args.episodes)}]
                for name, tabs in (("train", train), ("heldout", heldout))}
    baseline["cv"] = baseline["train"]  # the left-out tables together are the training tables

    def fitted(variant, idx):
        hidden = [signals.index(s) for s in GROUPS[variant]]

        def fit(X, y, w):
            X = np.array(X, dtype=np.float32)
            X[:, hidden] = 0.0
            return fit_tree(X, y, max_depth=opts.get("tree_depth", 6), min_samples_leaf=50, seed=opts.get("seed", 0),
                            ignore=("position",), sample_weight=w)

        return imitate([train[i] for i in idx], fit, k, price, opts.get("dagger_rounds", 2),
                       opts.get("label_episodes", 4), tuple(opts.get("behaviour_periods", (16, 192))),
                       seed=opts.get("seed", 0), schedules=[schedules[i] for i in idx]).controller

    def summarize(name, tree_rows):
        rows = baseline[name] + tree_rows
        matched_comparison(rows)
        saving = [r for r in tree_rows if r["refresh_savings"] is not None]
        best = max(saving, key=lambda r: r["refresh_savings"]) if saving else None
        return {"rows": [{k2: v for k2, v in r.items() if k2 != "per_prompt"} for r in rows],
                "best": None if best is None else {k2: best[k2] for k2 in (
                    "knob", "acceptance_length", "refreshes_per_1k", "refresh_savings")}}

    out = {}
    for variant in args.variants:
        every = fitted(variant, range(len(train)))
        out[variant] = {"hidden": list(GROUPS[variant]), "rules": every.describe()}
        for name, tabs in (("train", train), ("heldout", heldout)):
            out[variant][name] = summarize(name, [{"family": "tree", "knob": lv, **replay_counts(
                tabs, replace(every, decision=lv), k, args.episodes)} for lv in args.decisions])
        folds = {lv: [] for lv in args.decisions}
        for c in range(sources):
            ctrl = fitted(variant, [i for i in range(len(train)) if source[i] != c])
            for lv in args.decisions:
                folds[lv].append(replay_counts([train[i] for i in range(len(train)) if source[i] == c],
                                               replace(ctrl, decision=lv), k, args.episodes))
        out[variant]["cv"] = summarize("cv", [{"family": "tree", "knob": lv, **merge_tables(
            [p for f in folds[lv] for p in f["per_prompt"]])} for lv in args.decisions])
        print(f"{variant}: train {cell(out[variant]['train'])}; cv {cell(out[variant]['cv'])}; held-out "
              f"{cell(out[variant]['heldout'])}", file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(main())
