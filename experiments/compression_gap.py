"""How much of a compressed self-drafter's lost acceptance length is *reading* a compressed cache, how much *choosing*.

    python experiments/compression_gap.py --target testbed-lm --source-dir pip --prompts 8 \\
        --budgets 0.0625 0.125 0.25 --period 32 --output experiments/results/compression-gap-testbed-lm-pip.json
    python experiments/compression_gap.py --target testbed-lm --source-dir pip --lora runs/compressibility/adapter

The target drafts for itself (self-speculation) and, teacher-forced along its own greedy continuation of held-out
prompts (stored once: --targets-dir), is scored per position against its full-cache distribution under
(i) the full cache, (ii) RIFT-stat, (iii) RIFT-dyn (re-selected every --period tokens), (iv) a hindsight selection of
the same size (per row, layer and KV head the keys the dense model's attention at that row weights most: no real
scorer beats it). AL at temperature 1 (expected, from the acceptance probabilities) and 0 (exact, from top-1
agreement) with k = --draft-length drafts a round, per prompt, then averaged with 95% t-intervals over prompts:

    reading gap   = AL(i) - AL(iv)   what reading a compressed cache costs: what a LoRA on the drafter can recover
    selection gap = AL(iv) - AL(ii), AL(iv) - AL(iii)   what the scorer's choice costs

--lora DIR also scores the target with that adapter as the drafter (the masks still come from the unadapted base).
See rift_ada/trainers/compression_gap.py.
"""

from __future__ import annotations

import argparse
import sys

from rift_ada.cli import (ArgumentParser, add_runtime_options, add_task_options, apply_runtime, check_output, fail,
                          require_positive, tasks_from_args, write_output)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="testbed", help="the self-drafting target: a testbed name, folder or hub id")
    p.add_argument("--draft-adapter", "--lora", dest="lora", default=None, metavar="DIR",
                   help="a LoRA adapter folder: also score the target with it as the drafter (masks from the base)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.0625, 0.125, 0.25],
                   help="cache budgets as fractions of the prompt, in (0, 1] (default: %(default)s)")
    p.add_argument("--period", type=int, default=32,
                   help="RIFT-dyn re-selects every this many continuation tokens (default: %(default)s)")
    p.add_argument("--draft-length", type=int, default=11, help="drafts per round, k (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=128, help="continuation tokens scored per prompt")
    p.add_argument("--targets-dir", default=None, help="where the target outputs are kept (default: not kept)")
    p.add_argument("--output", default=None, help="write the numbers here (JSON)")
    add_task_options(p, prompts=8, input_tokens=2048, task="low")
    add_runtime_options(p)
    args = p.parse_args(argv)
    if any(not 0 < b <= 1 for b in args.budgets):
        p.error("--budgets are fractions of the prompt in (0, 1]")
    if args.period < 1:
        p.error("--period must be >= 1")
    require_positive(p, args, ("draft_length", "new_tokens", "prompts", "threads"))
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (the first continuation token is the target's, not drafted)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        apply_runtime(args)
        check_output(args.output)
        return _main(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)


def _main(args) -> int:
    from rift_ada import lora
    from rift_ada.data import encode_prompts
    from rift_ada.models import load_model, load_tokenizer, resolve
    from rift_ada.trainers import compressibility as C
    from rift_ada.trainers import compression_gap as G

    tokenizer = load_tokenizer(resolve(args.target))
    target = load_model(resolve(args.target), dtype=args.dtype, device=args.device)
    prompts = encode_prompts(tokenizer, tasks_from_args(args, tokenizer))
    samples = C.prompt_outputs(target, prompts, args.new_tokens, args.target, args.targets_dir)
    drafters = [(args.target, target)]
    if args.lora:
        drafters.append((f"{args.target} + {args.lora}", lora.load_drafter(target, args.lora, merge=True)))
    results = []
    for label, drafter in drafters:
        print(f"drafter {label} (masks from {args.target}):", flush=True)
        rows = G.gap_rows(drafter, samples, args.budgets, args.period, args.draft_length, scorer_model=target)
        gaps = G.gaps(rows)
        print_table(rows, gaps)
        results.append({"drafter": label, "rows": rows, "gaps": gaps})
    out = {"args": vars(args), "results": results}
    if args.lora:
        out["adapter_changes"] = G.adapter_changes(results[0]["rows"], results[1]["rows"])
        print_changes(out["adapter_changes"])
    write_output(args.output, out)
    return 0


def fmt(row: dict, stat: str) -> str:
    lo, hi = row[f"{stat}_lo"], row[f"{stat}_hi"]
    ci = f" [{lo:6.3f}, {hi:6.3f}]" if lo is not None else ""
    return f"{row[stat]:6.3f}{ci}"


def print_table(rows: list[dict], gaps: list[dict]) -> None:
    """Per budget: AL at T=1 and T=0 (95% intervals over prompts) of each setting, then the gaps."""
    full = next(r for r in rows if r["setting"] == "full")
    for b in sorted({r["budget_fraction"] for r in rows if r["budget_fraction"] is not None}):
        here = [full] + [r for r in rows if r["budget_fraction"] == b]
        keys = here[1]["keys_per_row"]
        print(f"\nbudget {100 * b:g}% of the prompt ({keys:g} keys per continuation row)")
        print(f"  {'setting':11s} {'AL T=1':24s} {'AL T=0':24s} {'accept':>7s} {'top1':>7s}")
        for r in here:
            print(f"  {r['setting']:11s} {fmt(r, 'al_t1'):24s} {fmt(r, 'al_t0'):24s} {r['accept']:7.4f} "
                  f"{r['top1']:7.4f}")
        for g in (g for g in gaps if g["budget_fraction"] == b):
            parts = [f"reading gap {fmt(g, 'reading_gap')} ({100 * g['reading_share']:.1f}% of full)"] + \
                [f"selection gap vs {s} {fmt(g, f'selection_gap_{s}')}" for s in ("stat", "dyn")
                 if f"selection_gap_{s}" in g]
            print(f"  T={g['temperature']}: " + "; ".join(parts))
    sys.stdout.flush()


def print_changes(changes: list[dict]) -> None:
    """The adapter's effect: AL untrained -> trained (relative change, 95% interval over prompts) per setting."""
    print("\nthe adapter: AL untrained -> trained (change [95% over prompts]); hindsight: share of the reading gap "
          "recovered")
    for c in changes:
        where = c["setting"] + ("" if c["budget_fraction"] is None else f" {100 * c['budget_fraction']:g}%")
        rec = "" if c["recovered"] is None else f"  recovered {100 * c['recovered']:+.0f}% of {c['reading_gap']:.3f}"
        print(f"  T={c['temperature']} {where:16s} {c['al_untrained']:6.3f} -> {c['al_trained']:6.3f} "
              f"({100 * c['relative_change']:+.1f}% [{100 * c['change_low']:+.1f}, {100 * c['change_high']:+.1f}])"
              f"{rec}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
