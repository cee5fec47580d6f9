"""The cache-policy table: AL of every policy, overall and by generation quarter, for both kinds of drafter.

    python experiments/policy_table.py            # testbed, 2K-token low-entropy prompts, budget 512, k = 11, greedy

Each cell is ``python -m rift_ada.evaluate`` with the same options (see ``--help`` there); the table is printed as
markdown and written with every number to --output (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys

from rift_ada.cli import ArgumentParser, add_runtime_options, apply_runtime, check_output, fail
from rift_ada.evaluate import build_parser, run

POLICIES = [("full", []), ("window", []), ("snapkv", []), ("rift-stat", []), ("rift-dyn", ["--period", "32"])]


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="testbed")
    p.add_argument("--drafters", nargs="+", default=["self", "testbed"], help="'self', 'testbed' or draft folders")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--period", type=int, default=32, help="rift-dyn refresh period")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--input-tokens", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--task", default="low")
    p.add_argument("--lookahead", type=int, default=64, help="snapkv scores extended forward (0 = plain SnapKV)")
    p.add_argument("--output", default=None, help="also write every number here (JSON)")
    add_runtime_options(p)
    args = p.parse_args(argv)
    rows = []
    try:
        apply_runtime(args)
        check_output(args.output)
        runtime = ["--device", args.device, "--threads", str(args.threads)]
        if args.dtype:
            runtime += ["--dtype", args.dtype]
        for drafter in args.drafters:
            for name, extra in POLICIES:
                if name == "rift-dyn":
                    extra = ["--period", str(args.period)]
                ev = build_parser().parse_args(
                    ["--target", args.target, "--drafter", drafter, "--policy", name, "--budget", str(args.budget),
                     "--prompts", str(args.prompts), "--input-tokens", str(args.input_tokens),
                     "--max-new-tokens", str(args.max_new_tokens), "--task", args.task,
                     "--lookahead", str(args.lookahead), "--json", *runtime, *extra])
                res = run(ev)
                res["drafter"] = drafter
                rows.append(res)
                print(f"{drafter:>8} {name:>10}: AL {res['acceptance_length']:.3f}", file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # ModelLoadError is a RuntimeError
        return fail(e)
    lines = ["| drafter | policy | AL | % of full | AL by quarter | refreshes | peak draft KV | greedy match |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full = next(x for x in rows if x["drafter"] == r["drafter"] and x["policy"] == "full")
        q = " / ".join("-" if v is None else f"{v:.2f}" for v in r["acceptance_length_by_quarter"])
        lines.append(f"| {r['drafter']} | {r['policy']} | {r['acceptance_length']:.3f} | "
                     f"{100 * r['acceptance_length'] / full['acceptance_length']:.1f}% | {q} | {r['refreshes']} | "
                     f"{r['draft_active_kv_bytes'] / 1024:.0f} KiB | {r['target_greedy_match']:.2f} |")
    print("\n".join(lines))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
