"""The cache-policy table: AL of every policy, overall and by generation quarter, for both kinds of drafter.

    python experiments/policy_table.py            # testbed, 2K-token low-entropy prompts, budget 512, k = 11, greedy

Each pair is loaded once and every cell is ``rift_ada.evaluate.evaluate`` on the same prompts (the numbers
``python -m rift_ada.evaluate`` prints for the same options); the table is printed as markdown and written with
every number to --output (JSON).
"""

from __future__ import annotations

import argparse
import sys

from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_runtime_options,
                          add_task_options, apply_runtime, check_output, decoding_from_args, fail, policy_from_args,
                          tasks_from_args, write_output)

POLICIES = ("full", "window", "snapkv", "rift-stat", "rift-dyn")


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="testbed")
    p.add_argument("--drafters", nargs="+", default=["self", "testbed"], help="'self', 'testbed' or draft folders")
    add_cache_options(p, policy=None)
    p.add_argument("--period", type=int, default=32, help="rift-dyn refresh period")
    add_decoding_options(p)
    add_task_options(p, prompts=8, input_tokens=2048, task="low")
    p.add_argument("--output", default=None, help="also write every number here (JSON)")
    add_runtime_options(p)
    args = p.parse_args(argv)
    rows, refs = [], None
    try:
        apply_runtime(args)
        check_output(args.output)
        policies = {name: policy_from_args(args, name, period=args.period if name == "rift-dyn" else None)
                    for name in POLICIES}
        from rift_ada.data import encode_prompts
        from rift_ada.evaluate import evaluate, greedy_references
        from rift_ada.models import load_pair
        from rift_ada.speculative import SpeculativeDecoder

        for drafter in args.drafters:
            pair = load_pair(args.target, drafter, device=args.device, dtype=args.dtype)
            prompts = encode_prompts(pair.tokenizer, tasks_from_args(args, pair.tokenizer))
            if refs is None and args.temperature == 0:  # the target's own output: one per prompt for every cell
                refs = greedy_references(pair.target, prompts, args.max_new_tokens, pair.tokenizer.eos_token_id,
                                         progress="target greedy")
            for name, policy in policies.items():
                dec = SpeculativeDecoder.for_pair(pair, policy.layout, decoding_from_args(args))
                ev = evaluate(dec, prompts, policy.controller, args.max_new_tokens,
                              greedy_check=args.temperature == 0, progress=f"{drafter} {name}", references=refs)
                rows.append({"drafter": drafter, "policy": name, "budget": policy.layout.budget, **ev.summary})
                print(f"{drafter:>8} {name:>10}: AL {ev.summary['acceptance_length']:.3f}", file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # ModelLoadError is a RuntimeError
        return fail(e)
    lines = ["| drafter | policy | AL | % of full | AL by quarter | refreshes | peak draft KV | greedy match |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full = next(x for x in rows if x["drafter"] == r["drafter"] and x["policy"] == "full")
        q = " / ".join("-" if v is None else f"{v:.2f}" for v in r["acceptance_length_by_quarter"])
        match = "-" if r["target_greedy_match"] is None else f"{r['target_greedy_match']:.2f}"
        lines.append(f"| {r['drafter']} | {r['policy']} | {r['acceptance_length']:.3f} | "
                     f"{100 * r['acceptance_length'] / full['acceptance_length']:.1f}% | {q} | {r['refreshes']} | "
                     f"{r['draft_active_kv_bytes'] / 1024:.0f} KiB | {match} |")
    print("\n".join(lines))
    write_output(args.output, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
