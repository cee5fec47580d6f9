"""Exported refresh controllers against periodic refresh and the oracle, on prompts of your choosing.

    python experiments/heldout_controller.py --controller runs/controller/controller-ppo.pt \
        --compare runs/controller/controller-tree.json --source-dir pip --seeds 2

The main job (``train_controller.py``) sweeps its controllers on a few prompts of a held-out code base; this script
looks closer: more prompts and seeds, another code base (``--source-dir``), temperature or pair. Every point is
decoded with the same decoder settings and seeds: the full cache, never refreshing, periodic refresh at each
``--periods``, the controller file (as ``python -m rift_ada.evaluate --policy rift-ada --controller FILE`` runs it:
loaded by ``rift_ada.refresh``, neither scikit-learn nor stable-baselines3 imported), any ``--compare`` controllers
(files, ``entropy:0.3``, ...). The oracle's points at each ``--oracle-lams`` come from replay tables of the same
prompts and seeds (built into ``--tables-dir`` once; ``rift_ada.replay.oracle``). It prints the table and the matched
comparison (refresh savings against periodic at matched AL, and the share of the oracle's saving at that AL each
captures) and writes every number to ``--output`` (JSON). ``--replay-only`` skips the real decoder and replays every
point on the tables (their expectation: many prompts for the time of a few decodes).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_model_options,
                          add_runtime_options, add_task_options, apply_runtime, check_output, decoding_from_args,
                          fail, policy_from_args, require_positive, tasks_from_args, write_output)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--controller", required=True, help="an exported controller file (controller.json / .pt)")
    p.add_argument("--compare", nargs="*", default=[],
                   help="more controllers to compare on the same prompts and seeds: files (each a family named by "
                        "its file name, e.g. the ablation's) or --controller spellings (periodic:N, entropy:X)")
    add_model_options(p, drafter="testbed")
    add_cache_options(p, policy=None, budget=256, refresh_grid=8)
    add_decoding_options(p, max_new_tokens=1024)
    p.set_defaults(draft_step="static", verify_step="static")
    add_task_options(p, prompts=3, input_tokens=1024, task="low,sort,high")
    p.add_argument("--seeds", type=int, default=2, help="decoder seeds per prompt and point (sampling)")
    p.add_argument("--periods", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--oracle-lams", type=float, nargs="*", default=[1.0, 2.0, 4.0, 8.0, 16.0],
                   help="the oracle's refresh prices (target rounds); none: no tables, no oracle")
    p.add_argument("--oracle-episodes", type=int, default=16, help="replays per table and price (sampling)")
    p.add_argument("--tables-dir", default="runs/heldout/tables", help="where the prompts' replay tables are kept")
    p.set_defaults(temperature=1.0)
    p.add_argument("--replay-only", action="store_true",
                   help="no real decode: every point replayed on the prompts' tables (expectation over "
                        "--oracle-episodes replays; many prompts for the time of a few decodes)")
    p.add_argument("--workers", type=int, default=2,
                   help="processes decoding the points side by side, each with its own copy of the pair")
    p.add_argument("--output", default=None, help="also write every number here (JSON)")
    add_runtime_options(p)
    args = p.parse_args(argv)
    require_positive(p, args, ("seeds", "budget", "max_new_tokens", "oracle_episodes", "workers"))
    if any(x < 1 for x in args.periods) or any(x < 0 for x in args.oracle_lams):
        p.error("--periods must be >= 1 and --oracle-lams >= 0")
    if args.replay_only and not args.oracle_lams:
        p.error("--replay-only needs tables: give --oracle-lams")
    return args


def points(args):
    from rift_ada.refresh import PeriodicController, load_controller, parse_controller
    from rift_ada.sweep import Point, full_point

    pts = [full_point(), Point("never", "-", None)]
    pts += [Point("periodic", n, PeriodicController(n)) for n in args.periods]
    pts.append(Point("controller", args.controller, load_controller(args.controller)))
    return pts + [Point(Path(spec).stem if Path(spec).suffix else spec, "-", parse_controller(spec))
                  for spec in args.compare]


def oracle_rows(args, pair, layout, decoding, prompts, seeds) -> tuple[list, list]:
    """(point, counts) of the oracle at each --oracle-lams, replayed on the prompts' tables (one per prompt and
    seed, the decoder's seeds: built into --tables-dir, or reused from there), and the tables."""
    from dataclasses import replace

    from rift_ada.replay import ReplayTable
    from rift_ada.replay.build import Builder, TableSpec, build_tables, prompt_sha
    from rift_ada.replay.oracle import oracle_counts
    from rift_ada.sweep import oracle_points

    if not args.oracle_lams:
        return [], []
    builder = Builder(args.target, args.drafter, layout, replace(decoding, draft_step="model", verify_step="model"),
                      args.max_new_tokens, args.device, args.dtype, args.threads)
    # seed-major, as rift_ada.sweep.merge_seeds lists a point's prompts (family_rows reads them so)
    specs = [TableSpec(f"p{i:03d}-s{s}-{prompt_sha(ids)}", tuple(ids), decoding.seed + s)
             for s in range(seeds) for i, ids in enumerate(prompts)]
    tables = [ReplayTable.load(p) for p in build_tables(builder, specs, args.tables_dir, pair, args.workers)]
    out = []
    for pt in oracle_points(args.oracle_lams):
        c = oracle_counts(tables, args.draft_length, pt.knob, args.oracle_episodes, args.seed)
        c["per_prompt"] = [{**x, "seed": j // len(prompts)} for j, x in enumerate(c["per_prompt"])]
        out.append((pt, c))
    return out, tables


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        apply_runtime(args)
        check_output(args.output)
        layout = policy_from_args(args, "rift-ada", controller="never").layout
        pts = points(args)
        from rift_ada.data import encode_prompts
        from rift_ada.models import load_pair
        from rift_ada.resume import RunState
        from rift_ada.sweep import tradeoff_row
        from rift_ada.tradeoff import matched_comparison
        from rift_ada.trainers.controller_job import stages, workers
        pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype)
        prompts = encode_prompts(pair.tokenizer, tasks_from_args(args, pair.tokenizer))
        decoding = decoding_from_args(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    seeds = args.seeds if args.temperature > 0 else 1  # greedy: every seed decodes the same tokens
    t0 = time.time()
    setting = workers.Setting(args.target, args.drafter, args.device, args.dtype, args.threads, decoding)
    if args.replay_only:
        from rift_ada.replay.process import full_counts, replay_counts

        oracle, tables = oracle_rows(args, pair, layout, decoding, prompts, seeds)
        eps = (args.draft_length, args.oracle_episodes, args.seed)
        counts = [full_counts(tables, *eps)] + [replay_counts(tables, pt.controller, *eps) for pt in pts[1:]]
    else:
        units = [(f"{i}", stages.sweep_unit, (pt, layout, prompts, args.max_new_tokens, seeds))
                 for i, pt in enumerate(pts)]
        counts = workers.run_units(RunState(), units, workers.Context(pair, decoding), setting,
                                   args.workers, "points", first=[f"{i}" for i, pt in enumerate(pts)
                                                                  if pt.family == "never"])
        oracle, tables = oracle_rows(args, pair, layout, decoding, prompts, seeds)
    pts, counts = pts + [p for p, _ in oracle], counts + [c for _, c in oracle]
    full_al = counts[0]["acceptance_length"]
    rows = [tradeoff_row(p, c, full_al) for p, c in zip(pts[1:], counts[1:])]
    summary = matched_comparison(rows)
    replayed = []
    if tables and not args.replay_only:  # every point again in replay on the same prompts' tables: like for like
        from rift_ada.replay.process import replay_counts

        replayed = [tradeoff_row(p, c if p.family == "oracle" else replay_counts(
            tables, p.controller, args.draft_length, args.oracle_episodes, args.seed), full_al)
            for p, c in zip(pts[1:], counts[1:])]
        matched_comparison(replayed)
    print(f"\n{'replayed: ' if args.replay_only else ''}{args.target} / {args.drafter}, T = {args.temperature:g}, "
          f"{len(prompts)} prompts ({args.task}"
          f"{', ' + args.source_dir if args.source_dir else ''}) x {seeds} seed(s), {args.max_new_tokens} new tokens, "
          f"budget {args.budget}: full-cache AL {full_al:.3f}")
    print("| family | knob | AL | +- | refreshes / 1K | fewer refreshes than periodic | share of oracle's saving |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        sav, share = r.get("refresh_savings"), r.get("oracle_share")
        print(f"| {r['family']} | {r['knob']} | {r['acceptance_length']:.3f} | {r['al_std']:.3f} | "
              f"{r['refreshes_per_1k']:.1f} | {'-' if sav is None else f'{100 * sav:.1f}%'} | "
              f"{'-' if share is None else f'{100 * share:.0f}%'} |")
    if replayed:
        print("\nreplayed on the same prompts' tables (expectation; the oracle's share at the same AL):")
        for r in replayed:
            sav, share = r.get("refresh_savings"), r.get("oracle_share")
            print(f"| {r['family']} | {r['knob']} | {r['acceptance_length']:.3f} | {r['refreshes_per_1k']:.1f} | "
                  f"{'-' if sav is None else f'{100 * sav:.1f}%'} | {'-' if share is None else f'{100 * share:.0f}%'} |")
    per_family = {}
    if "," in args.task and not (args.data or args.speedbench):
        from rift_ada.data import task_mix
        from rift_ada.sweep import family_rows

        for fam, frows in family_rows(pts, counts, task_mix(args.task)).items():
            fsum = matched_comparison(frows)["families"]
            per_family[fam] = {"rows": frows, "matched": fsum}
            line = ", ".join(f"{r['family']} {r['knob']} {r['acceptance_length']:.2f} @ {r['refreshes_per_1k']:.1f}"
                             for r in frows)
            sav = {k: v["refresh_savings"] for k, v in fsum.items()}
            print(f"{fam}: {line}; savings {({k: None if v is None else round(v, 3) for k, v in sav.items()})}")
    intervals = print_intervals(args, pts, counts, len(prompts))
    write_output(args.output, {"options": {k: v for k, v in vars(args).items()}, "full_acceptance_length": full_al,
                               "rows": rows, "matched": summary, "per_family": per_family, "replayed": replayed,
                               "intervals": intervals, "seconds": time.time() - t0})
    return 0


def print_intervals(args, pts, counts, n_prompts: int) -> dict:
    """Every compared family's savings at matched AL and share of the oracle's, each with a 95% bootstrap interval
    over the prompts (their seeds pooled), over all prompts and per task family."""
    from rift_ada.data import task_mix
    from rift_ada.tradeoff import compared_with_intervals, prompt_counts

    def tagged(c):  # replayed counts list their tables seed-major, untagged
        return {"per_prompt": [{"seed": j // n_prompts, **x} for j, x in enumerate(c["per_prompt"])]}

    per = [prompt_counts(tagged(c)) for c in counts]
    labels = [(p.family, p.knob) for p in pts]
    tasks = task_mix(args.task) if "," in args.task and not (args.data or args.speedbench) else []
    scopes = {"all": None, **{t: [i for i in range(n_prompts) if i % len(tasks) == f] for f, t in enumerate(tasks)}}
    out = {}
    print(f"\nwith 95% bootstrap intervals over the {n_prompts} prompts (savings at matched AL; share of the "
          "oracle's):")
    for scope, idx in scopes.items():
        if idx == []:
            continue
        out[scope] = compared_with_intervals(labels[1:], per[1:], per[0], idx, seed=args.seed)
        cells = []
        for fam, v in out[scope].items():
            iv = v["refresh_savings_interval"]
            if v.get("periodic_flat"):  # rift_ada.tradeoff.FLAT_GAIN: no periodic rate to match an AL against
                cells.append(f"{fam} undefined (periodic refresh gains no AL here)")
                continue
            sav = "n/a" if v["refresh_savings"] is None else f"{100 * v['refresh_savings']:.1f}%"
            sav += "" if iv is None else f" [{100 * iv[0]:.1f}, {100 * iv[1]:.1f}]"
            if fam != "oracle" and v["oracle_share"] is not None:
                si = v["oracle_share_interval"]
                sav += f", share {100 * v['oracle_share']:.0f}%" + ("" if si is None else
                                                                    f" [{100 * si[0]:.0f}, {100 * si[1]:.0f}]")
            cells.append(f"{fam} {sav}")
        print(f"  {scope}: " + "; ".join(cells))
    return out


if __name__ == "__main__":
    sys.exit(main())
