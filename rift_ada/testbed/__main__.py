"""``python -m rift_ada.testbed check``: measure the testbed pair (or any pair) on copy tasks."""

from __future__ import annotations

import argparse
import json
import sys

from ..cli import add_task_options, fail, tasks_from_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rift_ada.testbed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="greedy copy accuracy of target and draft, and their agreement",
                           description="Greedy copy accuracy of target and draft on held-out low-entropy prompts, "
                                       "and the draft's teacher-forced top-1 agreement with the target.")
    check.add_argument("--target", default="testbed", help="target: 'testbed', a local folder or a hub id")
    check.add_argument("--draft", default="testbed-draft", help="draft: 'testbed-draft', a local folder or a hub id")
    check.add_argument("--new-tokens", type=int, default=256, help="greedy tokens generated per prompt")
    add_task_options(check, prompts=12, input_tokens=2048, task="low")
    check.add_argument("--json", action="store_true", help="print one JSON object (summary only)")
    check.add_argument("--per-prompt", action="store_true", help="with --json: include one row per prompt")
    args = parser.parse_args(argv)

    try:
        from ..models import load_model, load_tokenizer
        from .check import run_check

        if args.json:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        if args.new_tokens < 1:
            raise ValueError("--new-tokens must be >= 1")
        tok = load_tokenizer(args.target)
        target, draft = load_model(args.target), load_model(args.draft)
        tasks = tasks_from_args(args, tok, require_reference=True)
        result = run_check(target, draft, tok, tasks, args.new_tokens, progress=not args.json)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    if not args.per_prompt:
        result.pop("per_prompt")
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            if k != "per_prompt":
                print(f"{k:>22}: {v:.4f}" if isinstance(v, float) else f"{k:>22}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
