"""The paper's regime on the shipped pair: 32K-token inputs, 4K-token outputs, an 8K-token draft budget, k = 11.

    python experiments/paper_regime.py                 # the default (README: its time and results)
    python experiments/paper_regime.py --input-tokens 4096 --reference-tokens 512 --max-new-tokens 512 --budget 1024

Prompts: the ``--task`` family (default ``low``: copy what the prompt holds) from ``--source-dir`` (default pip, never
trained or tuned on). Per prompt and temperature a replay table (``rift_ada.replay``: the target's continuation once,
the draft teacher-forced after every refresh time on a grid of ``--refresh-grid``, a selection reaching
``--lookahead`` past what its queries attended), then from the same continuation the caches that never refresh
(SnapKV's prefill selection, a sliding window), rift tables at the other ``--budgets`` (first temperature only) and,
with ``--self``, the target drafting for itself. Every file is a unit: a stopped run resumes (``--output-dir``).
From the tables (``rift_ada.studies.regime``), each a CSV and a PNG:
- ``staleness``: AL per ``--bin`` tokens of the generation for full, snapkv, window, rift-stat and rift-dyn
  (every ``--dyn-period`` tokens); ``retention.csv``: each over the whole generation against the same draft's full
  cache, with refreshes per 1K tokens; ``budgets``: rift-stat and rift-dyn at every budget;
- ``tradeoff-t<T>``: AL against refreshes per 1K tokens for periodic refresh at ``--periods``, never, every controller
  file in ``--controllers`` (the main job's exports, trained at 1K tokens; those trained at 8K, shipped in
  ``experiments/results/controller-8k``: docs/paper-regime.md) and the oracle, with savings against
  periodic at matched AL and the oracle's share (bootstrap intervals over prompts: 2 or more);
- ``summary.json`` and one W&B run (offline by default).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rift_ada.cli import (ArgumentParser, add_model_options, add_runtime_options, apply_runtime, fail,
                          require_positive)
from rift_ada.layout import covering_lookahead


def parse_args(argv=None):
    import argparse

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed")
    p.add_argument("--source-dir", default="pip", help="code base the prompts are built from (never trained on)")
    p.add_argument("--task", default="low", help="task family of the prompts (default %(default)s)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per temperature (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="task and sampling seed")
    p.add_argument("--input-tokens", type=int, default=32768)
    p.add_argument("--reference-tokens", type=int, default=4096,
                   help="tokens of the file a low prompt copies (at most; half qualify). docs/paper-regime.md")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--budget", type=int, default=8192, help="the draft cache's budget in tokens (default %(default)s)")
    p.add_argument("--budgets", type=int, nargs="*", default=[2048, 4096, 16384],
                   help="other budgets for the AL-by-budget figure (rift-stat and rift-dyn, first --temperatures)")
    p.add_argument("--draft-length", type=int, default=11, help="k (default %(default)s)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--self", dest="self_spec", action="store_true",
                   help="also the target drafting for itself under the same budget (self-speculation)")
    p.add_argument("--refresh-grid", type=int, default=64, help="the tables' refresh grid (default %(default)s)")
    p.add_argument("--lookahead", type=int, default=None,
                   help="how far past what recent queries attend a rift selection keeps (default: enough to cover "
                        "--dyn-period on the grid, layout.covering_lookahead: 256); SnapKV's baseline keeps none")
    p.add_argument("--dyn-period", type=int, default=64, help="rift-dyn's refresh period in tokens")
    p.add_argument("--periods", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--controllers", nargs="*", default=["runs/controller", "experiments/results/controller-8k"],
                   help="folders of exported controllers (controller-*.json / .pt, as the main job writes them) "
                        "or one file; a missing folder leaves them out")
    p.add_argument("--oracle-lams", type=float, nargs="*", default=[1.0, 4.0, 16.0, 64.0])
    p.add_argument("--episodes", type=int, default=16, help="replays per sampled table")
    p.add_argument("--bin", type=int, default=256, help="generation-position bin width in tokens")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the prompts")
    p.add_argument("--output-dir", default="runs/paper")
    p.add_argument("--wandb-project", default="rift-ada")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    add_runtime_options(p, threads=2)
    args = p.parse_args(argv)
    require_positive(p, args, ["prompts", "input_tokens", "reference_tokens", "max_new_tokens", "budget",
                               "draft_length", "refresh_grid", "dyn_period", "episodes", "bin", "resamples"])
    if args.lookahead is None:
        args.lookahead = covering_lookahead(args.dyn_period, args.refresh_grid, args.draft_length)
    elif args.lookahead < 0:
        p.error("--lookahead must be >= 0")
    if any(b < 1 for b in args.budgets + args.periods) or any(x < 0 for x in args.oracle_lams + args.temperatures):
        p.error("--budgets and --periods must be >= 1, --oracle-lams and --temperatures >= 0")
    if args.budget >= args.input_tokens or any(b >= args.input_tokens for b in args.budgets):
        p.error(f"every budget must be below --input-tokens ({args.input_tokens}): nothing to compress otherwise")
    return args


def tables_for(args, pair, prompts, temperature: float, out: Path):
    """Main tables (resumable, ``rift_ada.replay.build.build_tables``) and every table derived from them."""
    from rift_ada.layout import CacheLayout
    from rift_ada.studies.regime import Setting, table_name, tables_folder
    from rift_ada.replay import ReplayTable
    from rift_ada.replay.build import Builder, TableSpec, build_tables, derive_tables
    from rift_ada.speculative import Decoding

    def rift(budget):
        return CacheLayout("rift", budget=budget, refresh_grid=args.refresh_grid, lookahead=args.lookahead)

    layout = rift(args.budget)
    builder = Builder(args.target, args.drafter, layout, Decoding(args.draft_length, temperature, seed=args.seed),
                      args.max_new_tokens, args.device, args.dtype, args.threads)
    specs = [TableSpec(table_name(i, ids), tuple(ids), args.seed) for i, ids in enumerate(prompts)]
    folder = tables_folder(out, temperature)
    main = [ReplayTable.load(p) for p in build_tables(builder, specs, folder, pair, 1, f"tables T={temperature:g}")]
    derived = {"snapkv": CacheLayout("snapkv", budget=args.budget, lookahead=0),
               "window": CacheLayout("window", budget=args.budget),
               **{f"b{b}": rift(b) for b in (args.budgets if temperature == args.temperatures[0] else [])}}
    if args.self_spec:
        derived.update({"self": layout, "self-snapkv": derived["snapkv"], "self-window": derived["window"]})
    got = {k: [] for k in derived}
    for spec, base in zip(specs, main):
        for key, table in derive_tables(pair, base, derived, folder / spec.name).items():
            got[key].append(table)
    settings = [Setting(temperature, "external", main, {k: got[k] for k in ("snapkv", "window")},
                        {b: got[f"b{b}"] for b in args.budgets if f"b{b}" in got})]
    if args.self_spec:
        settings.append(Setting(temperature, "self", got["self"],
                                {"snapkv": got["self-snapkv"], "window": got["self-window"]}))
    return settings


def tradeoff(s, learned: dict, args):
    """The replayed tradeoff over one setting's tables: rows with intervals and the families' matched comparison."""
    from types import SimpleNamespace

    from rift_ada.refresh import PeriodicController
    from rift_ada.replay.oracle import oracle_counts
    from rift_ada.replay.process import full_counts, replay_counts
    from rift_ada.sweep import Point, full_point, oracle_points
    from rift_ada.trainers.controller_job.report import Swept, replayed_tradeoff

    eps = (args.draft_length, args.episodes, args.seed)
    pts = [full_point(), Point("never", "-", None)]
    pts += [Point("periodic", n, PeriodicController(n)) for n in args.periods]
    pts += [Point(kind, "-", c) for kind, c in learned.items()]
    counts = [full_counts(s.main, *eps)] + [replay_counts(s.main, p.controller, *eps) for p in pts[1:]]
    for p in oracle_points(args.oracle_lams):
        pts.append(p)
        counts.append(oracle_counts(s.main, args.draft_length, p.knob, args.episodes, args.seed))
    opts = SimpleNamespace(eval_seeds=1, resamples=args.resamples, seed=args.seed)
    rows, fams = replayed_tradeoff(Swept(pts, counts), opts, None)
    if len(s.main) < 2:  # resampling one prompt gives zero-width intervals: say there is none
        fams = {f: {k: None if k.endswith("_interval") else x for k, x in v.items()} for f, v in fams.items()}
    return rows, fams


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        apply_runtime(args)
        from rift_ada.models import load_pair
        from rift_ada.refresh import load_controllers
        from rift_ada.studies.regime import regime_prompts

        learned = load_controllers(args.controllers)
        pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype)
        prompts = regime_prompts(pair.tokenizer, vars(args))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    from rift_ada.studies import regime
    from rift_ada.trainers.controller_job.report import COLUMNS, plot, write_csv

    out, t0 = Path(args.output_dir), time.time()
    out.mkdir(parents=True, exist_ok=True)
    if not learned:
        print(f"no exported controllers in {args.controllers}: the tradeoff shows periodic refresh and the oracle "
              "(run experiments/train_controller.py first, or give --controllers)")
    settings = [s for temp in args.temperatures for s in tables_for(args, pair, prompts, temp, out)]
    seconds = {"tables": time.time() - t0}
    r = regime.Replays(args.draft_length, args.episodes, args.seed, args.bin, args.resamples, args.dyn_period)
    bins, whole = regime.staleness(settings, r)
    budgets = regime.by_budget(settings, args.budget, r)
    write_csv(out / "staleness.csv", bins, list(bins[0]))
    write_csv(out / "retention.csv", whole, list(whole[0]))
    regime.plot_staleness(out / "staleness.png", bins, settings, args.bin)
    if budgets:
        write_csv(out / "budgets.csv", budgets, list(budgets[0]))
        regime.plot_budgets(out / "budgets.png", budgets, whole)
    trade = {}
    for s in settings:
        if s.drafter == "external":
            rows, fams = tradeoff(s, learned, args)
            trade[s.temperature] = {"rows": rows, "families": fams}
            write_csv(out / f"tradeoff-t{s.temperature:g}.csv", rows, COLUMNS)
            plot(out / f"tradeoff-t{s.temperature:g}.png", rows, "acceptance_length", "acceptance length (replayed)",
                 f"{len(s.main)} {args.task} prompt(s) of {args.source_dir}, {args.input_tokens} in / "
                 f"{args.max_new_tokens} out, budget {args.budget}, T = {s.temperature:g}", full=rows[0])
    seconds["analysis"] = time.time() - t0 - seconds["tables"]
    summary = {"options": vars(args), "prompt_tokens": [len(p) for p in prompts], "retention": whole, "bins": bins,
               "budgets": budgets, "staleness": [regime.staleness_statement(bins, s) for s in settings],
               "tradeoff": {f"{k:g}": v for k, v in trade.items()}, "seconds": seconds}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log_wandb(args, out, summary, trade)
    report(summary, whole, trade, args)
    return 0


def log_wandb(args, out: Path, summary: dict, trade: dict) -> None:
    """One W&B run: the CSVs as tables, the PNGs as images, the headline numbers in its summary."""
    import csv
    import wandb

    run = wandb.init(project=args.wandb_project, mode=args.wandb_mode, dir=str(out), config=vars(args),
                     job_type="paper_regime")
    logged = {}
    for f in sorted(out.glob("*.csv")):
        rows = list(csv.DictReader(open(f)))
        if rows:
            logged[f"{f.stem}/table"] = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
    logged.update({f"{f.stem}/image": wandb.Image(str(f)) for f in sorted(out.glob("*.png"))})
    run.log(logged)
    for w in summary["retention"]:
        run.summary[f"retention/T{w['temperature']:g}/{w['drafter']}/{w['policy']}"] = w["al_vs_full"]
    for temp, v in trade.items():
        for fam, s in v["families"].items():
            for stat in ("refresh_savings", "oracle_share", "al_gain"):
                run.summary[f"tradeoff/T{temp:g}/{fam}/{stat}"] = s.get(stat)
    run.finish()


def report(summary: dict, whole: list, trade: dict, args) -> None:
    from rift_ada.trainers.controller_job.report import headline_line, span

    print(f"\n{args.prompts} {args.task} prompt(s) of {args.source_dir} ({summary['prompt_tokens']} tokens), "
          f"{args.max_new_tokens} new tokens, budget {args.budget}, k = {args.draft_length}; replayed "
          f"({args.episodes} replays per sampled table)")
    for w in whole:
        iv = None if w["vs_full_lo"] is None else (w["vs_full_lo"], w["vs_full_hi"])
        print(f"  T={w['temperature']:g} {w['drafter']:8s} {w['policy']:9s} AL {w['acceptance_length']:.3f}"
              f"{span(None if w['al_lo'] is None else (w['al_lo'], w['al_hi']), 1.0, '.3f')}  "
              f"{100 * w['al_vs_full']:.1f}%{span(iv)} of full, {w['refreshes_per_1k']:.2f} refreshes / 1K")
    print("\n".join("  " + line for line in summary["staleness"]))
    for b in summary["budgets"]:
        print(f"  budget {b['budget']:6d} T={b['temperature']:g} {b['policy']:9s} AL {b['acceptance_length']:.3f} "
              f"({100 * b['al_vs_full']:.1f}% of full)")
    for temp, v in trade.items():
        print(f"  tradeoff T={temp:g}:\n" + "\n".join("    " + headline_line(f, s) for f, s in v["families"].items()))
    print(f"  files in {args.output_dir}; {summary['seconds']['tables']:.0f} s tables, "
          f"{summary['seconds']['analysis']:.0f} s replays")


if __name__ == "__main__":
    sys.exit(main())
