"""The main job's learned controller with one ingredient taken away at a time: controller files for an ablation.

    python experiments/controller_ablation.py --run runs/controller --out runs/ablation
    python experiments/heldout_controller.py --controller runs/controller/controller.json \
        --compare runs/ablation/*.json --source-dir DIR

Refits on the counterfactual data a finished (or resumed) main job stored in ``<run>/state`` and writes one
controller file per variant, each at the decision level of the exported controller:

| file | what changes |
|---|---|
| `tree.json` | nothing: the main job's recipe (tree, 'wait' labels, every signal) |
| `tree-no-readahead.json` | the read-ahead signals (runway, focus) are hidden from the fit |
| `tree-now-label.json` | labels ask 'refresh now versus never' instead of 'now versus a round later' |
| `logistic.json` | a logistic model instead of the tree (same labels and signals) |
| `logistic-no-readahead.json` | both of the above |

``heldout_controller.py --compare`` then decodes them all on the same prompts and seeds. A hidden signal is a
constant column during the fit, so no split (and no weight) can use it; the file still reads the full observation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from rift_ada.cli import ArgumentParser, fail

READ_AHEAD = ("runway", "focus")


def load_data(run: Path):
    from rift_ada import signals

    units = sorted((run / "state").glob("counterfactual-*.json"))
    if not units:
        raise FileNotFoundError(f"{run}/state holds no counterfactual data: run experiments/train_controller.py first")
    parts = [json.loads(u.read_text()) for u in units]
    config = json.loads((run / "state" / "config.json").read_text())
    X = np.asarray([x for p in parts for x in p["X"]], dtype=np.float32).reshape(-1, len(signals.NAMES))
    gain = np.asarray([g for p in parts for g in p["gain"]])
    wait = np.asarray([g for p in parts for g in p["wait"]])
    return X, gain, wait, config


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/controller", help="a main job's --output-dir")
    p.add_argument("--out", default="runs/ablation", help="folder for the controller files")
    args = p.parse_args(argv)
    try:
        X, gain, wait, config = load_data(Path(args.run))
    except (FileNotFoundError, ValueError, KeyError) as e:
        return fail(e)
    from rift_ada import signals
    from rift_ada.controllers import fit_logistic, fit_tree
    from rift_ada.trainers.counterfactual import CounterfactualData

    from controller_job.stages import TREE_IGNORES

    opts = config.get("options", config)
    margin = opts.get("label_margin")
    margin = opts.get("refresh_cost", 2.0) if margin is None else margin
    data = CounterfactualData(X, gain, opts.get("horizon", 4), wait)
    hidden = X.copy()
    hidden[:, [signals.index(n) for n in READ_AHEAD]] = 0.0
    exported = json.loads((Path(args.run) / "metrics.json").read_text())["best"] if (
        Path(args.run) / "metrics.json").exists() else {"family": "tree", "knob": 0.5}
    level = float(exported["knob"])
    depth = opts.get("tree_depth", 3)
    tree = dict(max_depth=depth, ignore=TREE_IGNORES, decision=level)
    variants = {
        "tree": lambda: fit_tree(X, data.labels(margin, "wait"), **tree),
        "tree-no-readahead": lambda: fit_tree(hidden, data.labels(margin, "wait"), **tree),
        "tree-now-label": lambda: fit_tree(X, data.labels(margin, "now"), **tree),
        "logistic": lambda: fit_logistic(X, data.labels(margin, "wait"), threshold=level),
        "logistic-no-readahead": lambda: fit_logistic(hidden, data.labels(margin, "wait"), threshold=level),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, fit in variants.items():
        ctrl = fit()
        ctrl.save(out / f"{name}.json")
        print(f"{out / name}.json: {ctrl.kind}, decision level {level:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
