"""Replay tables from the command line.

    python -m rift_ada.replay build --prompts 8 --source-dir pip --output-dir runs/tables     # a prompt set
    python -m rift_ada.replay build --drafter self --draft-adapter runs/lora/adapter ...       # a LoRA self-drafter
    torchrun --nproc-per-node 2 -m rift_ada.replay build ...                                  # shared out
    python -m rift_ada.replay show runs/tables/table-000-s0.safetensors                       # what one holds

``build`` makes one table per prompt (and, sampling, per ``--seeds`` seed: tables-per-prompt sampled continuations)
in ``--output-dir`` as ``table-<prompt>-s<seed>.safetensors``, with a progress bar, in ``--workers`` processes or
shared out under torchrun; tables already there with the same models, settings, prompt and seed are kept, so an
interrupted build resumes. ``show`` prints a table's provenance and the replayed acceptance length of the full
cache, never refreshing, periodic refresh (counted from each refresh, and on the grid: ``process.on_grid``) and the
oracle.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from ..cli import (ArgumentParser, add_cache_options, add_decoding_options, add_model_options, add_runtime_options,
                   add_task_options, apply_runtime, decoding_from_args, fail_in_group, policy_from_args,
                   tasks_from_args)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m rift_ada.replay", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="tables for a prompt set", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.error = p.error
    add_model_options(b, drafter="testbed")
    b.add_argument("--draft-adapter", default=None, metavar="DIR",
                   help="a LoRA adapter folder for the drafter; with --drafter self it lives in the target's own "
                        "weights, on in the draft passes and off in the target's (an external drafter gets a copy "
                        "with the adapter merged)")
    add_cache_options(b, policy=None, budget=256, refresh_grid=8)
    add_decoding_options(b, max_new_tokens=1024)
    add_task_options(b, prompts=8, input_tokens=1024, task="low,sort,high")
    b.add_argument("--seeds", type=int, default=1, help="sampled continuations (tables) per prompt when sampling")
    b.add_argument("--output-dir", default="runs/tables")
    b.add_argument("--workers", type=int, default=1, help="processes building tables side by side")
    add_runtime_options(b)
    s = sub.add_parser("show", help="a table's provenance and replayed acceptance lengths")
    s.error = p.error
    s.add_argument("table")
    s.add_argument("--draft-length", type=int, default=11)
    s.add_argument("--periods", type=int, nargs="*", default=[16, 32, 64, 128])
    s.add_argument("--price", type=float, default=4.0, help="the oracle's refresh price in target rounds")
    s.add_argument("--json", action="store_true")
    return p


def build(args) -> int:
    from .. import distributed
    from ..models import load_pair
    from .build import Builder, TableSpec, build_tables, with_adapter

    apply_runtime(args)
    for name in ("seeds", "workers", "max_new_tokens", "prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    args.device = distributed.local_device(args.device)
    distributed.init(args.device)
    layout = policy_from_args(args, "rift-ada", controller="never").layout
    decoding = decoding_from_args(args, draft_step="model", verify_step="model")
    if args.source_dir not in (None, "stdlib"):
        from ..data.sources import source_folder

        source_folder(args.source_dir)  # a code base that is not there fails before the models load
    if args.draft_adapter is not None:
        from ..lora import check_adapter

        check_adapter(args.draft_adapter)  # a broken adapter folder fails before the models load too
    pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype)
    pair = with_adapter(pair, args.draft_adapter)  # an adapter of another model is refused here, in one line
    from ..data import encode

    prompts = [encode(pair.tokenizer, t.prompt) for t in tasks_from_args(args, pair.tokenizer)]
    seeds = args.seeds if decoding.temperature > 0 else 1
    specs = [TableSpec(f"table-{i:03d}-s{s}", tuple(ids), decoding.seed + s)
             for i, ids in enumerate(prompts) for s in range(seeds)]
    builder = Builder(args.target, args.drafter, layout, decoding, args.max_new_tokens, args.device, args.dtype,
                      args.threads, args.draft_adapter)
    paths = build_tables(builder, specs, args.output_dir, pair, 1 if distributed.world_size() > 1 else args.workers)
    if distributed.is_main():
        print(f"{len(paths)} tables in {args.output_dir}")
    return 0


def show(args) -> int:
    from ..layout import CacheLayout
    from ..refresh import PeriodicController
    from .oracle import oracle_counts
    from .process import full_counts, on_grid, replay_counts
    from .table import ReplayTable

    table = ReplayTable.load(args.table)
    CacheLayout(**table.header["layout"])  # a header the layout class refuses is not a table for this version
    k = args.draft_length
    full_al = full_counts([table], k)["acceptance_length"]
    rows = {"never": replay_counts([table], None, k)}
    rows.update({f"periodic {n}": replay_counts([table], PeriodicController(n), k) for n in args.periods})
    rows.update({f"periodic {n} on grid": replay_counts([table], on_grid(n), k) for n in args.periods})
    rows[f"oracle {args.price:g}"] = oracle_counts([table], k, args.price)
    h = table.header
    out = {"header": {key: v for key, v in h.items()}, "prompt_tokens": table.prompt_len,
           "continuation_tokens": int(table.tokens.shape[0]), "rows": table.rows, "full_cache_al": full_al,
           "replayed": {n: {"acceptance_length": r["acceptance_length"], "refreshes_per_1k": r["refreshes_per_1k"]}
                        for n, r in rows.items()}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.table}: {table.prompt_len} prompt + {out['continuation_tokens']} continuation tokens, {table.rows} "
          f"rows (grid {table.grid}), T = {table.temperature:g}, seed {h['seed']}")
    print(f"target {h['target_name'] or '?'} ({h['target']}), draft {h['draft_name'] or '?'} ({h['draft']}), layout "
          f"{CacheLayout(**h['layout']).describe()}; built in {sum(h['build_seconds'].values()):.1f} s")
    print(f"{'full cache':>22}: AL {full_al:.3f}")
    for name, r in out["replayed"].items():
        print(f"{name:>22}: AL {r['acceptance_length']:.3f}, {r['refreshes_per_1k']:.1f} refreshes per 1K")
    return 0


def main(argv=None) -> int:
    from .. import distributed

    p = build_parser()
    if distributed.is_main():
        args = p.parse_args(argv)
    else:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = p.parse_args(argv)
    try:
        with distributed.leaving():
            return build(args) if args.command == "build" else show(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail_in_group(e)


if __name__ == "__main__":
    sys.exit(main())
