"""How closely replay tables follow the real decoder: the same prompts and refresh schedules, decoded and replayed.

    python experiments/replay_fidelity.py --controller runs/controller/controller-tree.json    # 2 cores: ~45 min

For each prompt (and, sampling, each seed) it builds the prompt's table (``rift_ada.replay``), then runs every
schedule twice: in the real decoder (``SpeculativeDecoder``, the layout's refresh grid) and in replay. Schedules:
never, periodic at each ``--periods``, the oracle's (the table's best schedule at ``--oracle-price``: a policy over
(tokens generated, pending, row), which drives the real decoder too), and ``--controller`` files. Greedy, a round is
equal when its position, accepted count and refresh agree with the replayed round of the same index (a schedule
that diverges once counts every later round as unequal); sampling, the real decoder's AL over seeds is compared with
the replay's expected AL (``--episodes`` replays of each seed's table). Writes every number to
``<output-dir>/fidelity.json`` and prints the summary; units are stored as they finish (``--resume``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_model_options,
                          add_runtime_options, apply_runtime, decoding_from_args, fail, policy_from_args,
                          require_positive)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed")
    add_cache_options(p, policy=None, budget=256, refresh_grid=8)
    add_decoding_options(p, max_new_tokens=512)
    p.set_defaults(draft_step="static", verify_step="static")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--task", default="low,sort,high")
    p.add_argument("--input-tokens", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--seeds", type=int, default=4, help="decoder seeds (and tables) per prompt when sampling")
    p.add_argument("--source-dir", default="pip", help="code base of the prompts ('stdlib': its held-out split)")
    p.add_argument("--periods", type=int, nargs="*", default=[16, 32, 64, 128])
    p.add_argument("--controller", nargs="*", default=[], help="learned controller files to compare as well")
    p.add_argument("--oracle-price", type=float, default=4.0, help="the oracle schedule's refresh price (rounds)")
    p.add_argument("--episodes", type=int, default=64, help="replays per table when sampling")
    p.add_argument("--paired", action="store_true",
                   help="sampling: replay each real run on a table of its own emitted tokens (the acceptance process "
                        "given the same continuation: no sampling noise between the two; the oracle is skipped)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--output-dir", default="runs/fidelity")
    p.add_argument("--resume", action="store_true")
    add_runtime_options(p)
    args = p.parse_args(argv)
    require_positive(p, args, ("prompts", "seeds", "episodes", "workers", "max_new_tokens"))
    return args


def schedules(args) -> list[tuple[str, object]]:
    from rift_ada.refresh import NeverController, PeriodicController, load_controller

    out = [("never", NeverController())] + [(f"periodic-{n}", PeriodicController(n)) for n in args.periods]
    out += [(Path(f).stem, load_controller(f)) for f in args.controller]
    return out + [("oracle", None)]


def unit(ctx, table_path, ids, temperature, seed, layout, args) -> dict:
    """One (prompt, temperature, seed): every schedule in the real decoder and in replay."""
    from rift_ada.replay import ReplayTable
    from rift_ada.replay.build import build_table
    from rift_ada.replay.fidelity import al, real_rounds, refreshes, replayed
    from rift_ada.replay.oracle import solve

    table = None if table_path is None else ReplayTable.load(table_path)  # None: paired, built per run below
    from rift_ada.speculative import SpeculativeDecoder

    # a decoder of its own: the static steps sample as the temperature they were built with says
    decoder = SpeculativeDecoder.for_pair(ctx.pair, layout, replace(ctx.decoding, temperature=temperature, seed=seed))
    out = {}
    paired = args.paired and temperature > 0
    for name, controller in schedules(args):
        if paired and name == "oracle":  # its schedule is the best for a table the decoder did not emit
            continue
        policy = solve(table, args.draft_length, args.oracle_price) if name == "oracle" else None
        real = real_rounds(decoder, ids, args.max_new_tokens, controller, policy, layout.refresh_grid)
        if paired:  # the table of the continuation this run emitted
            table = build_table(ctx.pair.target, ctx.pair.draft, ids, layout, replace(ctx.decoding,
                                temperature=temperature, seed=seed), args.max_new_tokens,
                                ctx.pair.tokenizer.eos_token_id, tokens=decoder.result.tokens)
        reps = replayed(table, args.draft_length, controller, policy, args.episodes, seed)
        out[name] = {"real_al": al(real), "real_refreshes": refreshes(real),
                     "replay_al": float(np.mean([al(rep) for rep in reps])),
                     "replay_refreshes": float(np.mean([refreshes(rep) for rep in reps])),
                     "rounds": len(real)}
        if temperature == 0:
            rep = reps[0]
            out[name]["equal_rounds"] = sum(a == b for a, b in zip(real, rep))
            out[name]["compared_rounds"] = max(len(real), len(rep))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.output_dir)
    try:
        apply_runtime(args)
        from rift_ada.trainers.controller_job import workers
        from rift_ada.data import build_task_mix, encode
        from rift_ada.data.sources import source_folder
        from rift_ada.models import load_pair
        from rift_ada.replay.build import Builder, TableSpec, build_tables
        from rift_ada.resume import RunState, write_json

        layout = policy_from_args(args, "rift-ada", controller="never").layout
        schedules(args)  # a bad controller file fails here
        pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype)
        folder = None if args.source_dir == "stdlib" else source_folder(args.source_dir)
        tasks = build_task_mix(pair.tokenizer, args.task, args.prompts, args.input_tokens, args.seed, "eval",
                               source_dir=folder)
        prompts = [encode(pair.tokenizer, t.prompt) for t in tasks]
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    t0 = time.time()
    decoding = decoding_from_args(args)
    state = RunState(out / "state")
    units, keys = [], []
    for temperature in args.temperatures:
        seeds = args.seeds if temperature > 0 else 1
        builder = Builder(args.target, args.drafter, layout, replace(decoding, temperature=temperature,
                                                                     draft_step="model", verify_step="model"),
                          args.max_new_tokens, args.device, args.dtype, args.threads)
        specs = [TableSpec(f"t{temperature:g}-p{i:02d}-s{s}", tuple(ids), args.seed + s)
                 for i, ids in enumerate(prompts) for s in range(seeds)]
        if args.paired and temperature > 0:  # each run builds the table of its own continuation instead
            paths = [None] * len(specs)
        else:
            paths = build_tables(builder, specs, out / "tables", pair, args.workers,
                                 progress=f"tables T={temperature:g}")
        for spec, path in zip(specs, paths):
            units.append((spec.name, unit, (path and str(path), list(spec.prompt), temperature, spec.seed, layout,
                                            args)))
            keys.append((temperature, spec.name))
    setting = workers.Setting(args.target, args.drafter, args.device, args.dtype, args.threads, decoding)
    results = workers.run_units(state, units, workers.Context(pair, decoding), setting, args.workers,
                                "real decoder vs replay")
    summary = summarize(keys, results, args)
    write_json(out / "fidelity.json", {"options": {k: v for k, v in vars(args).items()}, "summary": summary,
                                        "units": dict(zip([n for _, n in keys], results)),
                                        "seconds": time.time() - t0})
    for t, rows in summary.items():
        print(f"\nT = {t}")
        for name, r in rows.items():
            eq = f" | equal rounds {100 * r['equal_share']:.1f}%" if "equal_share" in r else ""
            se = "" if r["real_minus_replay_se"] is None else f" +- {r['real_minus_replay_se']:.3f}"
            print(f"{name:>14}: AL real {r['real_al']:.3f} replay {r['replay_al']:.3f} ({100 * r['al_diff']:+.2f}%, "
                  f"real - replay {r['real_minus_replay']:+.3f}{se}) | "
                  f"refreshes real {r['real_refreshes']:.1f} replay {r['replay_refreshes']:.1f}{eq}")
    return 0


def summarize(keys, results, args) -> dict:
    """Per temperature and schedule: mean AL and refreshes (real, replay) over prompts and seeds, their relative
    difference, and greedy the share of equal rounds."""
    out = {}
    for t in args.temperatures:
        mine = [r for (temp, _), r in zip(keys, results) if temp == t]
        rows = {}
        for name in mine[0]:
            if name == "seconds":
                continue
            xs = [m[name] for m in mine]
            real, rep = np.mean([x["real_al"] for x in xs]), np.mean([x["replay_al"] for x in xs])
            diff = [x["real_al"] - x["replay_al"] for x in xs]
            rows[name] = {"real_al": float(real), "replay_al": float(rep), "al_diff": float(rep / real - 1),
                          "real_minus_replay": float(np.mean(diff)),
                          "real_minus_replay_se": float(np.std(diff, ddof=1) / np.sqrt(len(diff))) if len(diff) > 1
                          else None,
                          "real_refreshes": float(np.mean([x["real_refreshes"] for x in xs])),
                          "replay_refreshes": float(np.mean([x["replay_refreshes"] for x in xs])), "runs": len(xs)}
            if t == 0:
                rows[name]["equal_share"] = (sum(x["equal_rounds"] for x in xs) /
                                             sum(x["compared_rounds"] for x in xs))
        out[f"{t:g}"] = rows
    return out


if __name__ == "__main__":
    sys.exit(main())
