"""``python -m rift_ada.testbed check``: measure the testbed pair (or any pair) on copy tasks."""

from __future__ import annotations

import json
import sys

from rift_ada.cli import ArgumentParser, add_runtime_options, add_task_options, apply_runtime, fail, tasks_from_args


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m rift_ada.testbed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="greedy copy accuracy of target and draft, and their agreement",
                           description="Greedy copy accuracy of target and draft on held-out low-entropy prompts, "
                                       "and the draft's teacher-forced top-1 agreement with the target.")
    check.add_argument("--target", default="testbed", help="target: 'testbed', a local folder or a hub id")
    check.add_argument("--draft", default="testbed-draft", help="draft: 'testbed-draft', a local folder or a hub id")
    check.add_argument("--new-tokens", type=int, default=256, help="greedy tokens generated per prompt")
    add_task_options(check, prompts=12, input_tokens=2048, task="low", several_lengths=True)
    add_runtime_options(check)
    check.add_argument("--code-windows", type=int, default=32,
                       help="plain-code windows of 1,024 tokens for code top-1 / NLL (0: skip; default %(default)s; "
                            "with several --input-tokens, at the first only)")
    check.add_argument("--family-prompts", type=int, default=None,
                       help="prompts of the 'high' and 'sort' families for draft_agreement_high and "
                            "target_sort_accuracy (default: --prompts; 0: skip; with several --input-tokens, at the "
                            "first only)")
    check.add_argument("--json", action="store_true", help="print one JSON object (summary only)")
    check.add_argument("--per-prompt", action="store_true", help="with --json: include one row per prompt")
    args = parser.parse_args(argv)

    try:
        apply_runtime(args)
        from rift_ada.models import load_model, load_tokenizer

        if args.json:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        if args.new_tokens < 1:
            raise ValueError("--new-tokens must be >= 1")
        if args.code_windows < 0 or (args.family_prompts is not None and args.family_prompts < 0):
            raise ValueError("--code-windows and --family-prompts must be >= 0")
        tok = load_tokenizer(args.target)
        target = load_model(args.target, dtype=args.dtype, device=args.device)
        draft = load_model(args.draft, dtype=args.dtype, device=args.device)
        lengths = list(dict.fromkeys(args.input_tokens))
        if min(lengths) < 1:
            raise ValueError("--input-tokens must be >= 1")
        if len(lengths) > 1 and (args.data or args.speedbench):
            raise ValueError("several --input-tokens need built tasks (not --data or --speedbench)")
        results = []
        for i, length in enumerate(lengths):
            args.input_tokens = length
            result = _check_one(args, tok, target, draft, families=i == 0)
            results.append({"input_tokens": length, **result} if len(lengths) > 1 else result)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    for result in results:
        if not args.per_prompt:
            result.pop("per_prompt")
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else {"lengths": results}))
    else:
        for length, result in zip(lengths, results):
            if len(results) > 1:
                print(f"--- {length} input tokens")
            for k, v in result.items():
                if k == "costs":
                    print(f"{k:>22}: " + ", ".join(f"{name} {x:g}" for name, x in v.items()))
                elif k != "per_prompt":
                    print(f"{k:>22}: {v:.4f}" if isinstance(v, float) else f"{k:>22}: {v}")
    return 0


def _check_one(args, tok, target, draft, families: bool) -> dict:
    """The check at ``args.input_tokens``: the copy prompts, and with ``families`` (the first length only) the high
    and sort families (built tasks) and the plain-code windows: short-context quality, which a long-context run need
    not pay for at every length."""
    from .check import run_check

    tasks = tasks_from_args(args, tok, require_reference=True)
    extra = {}
    built = not (args.data or args.speedbench)
    n_family = args.prompts if args.family_prompts is None else args.family_prompts
    if built and families and n_family > 0:
        from rift_ada.data.tasks import build_tasks

        for family, key in (("high", "high_tasks"), ("sort", "sort_tasks")):
            extra[key] = build_tasks(tok, family, n=n_family, input_tokens=args.input_tokens, seed=args.seed,
                                     source_dir=args.source_dir)
    if families and args.code_windows > 0:
        from rift_ada.data.corpus import load_corpus
        from .check import code_windows

        files = load_corpus(args.source_dir, "all" if args.source_dir else "eval")
        extra["code_windows"] = code_windows(tok, files, args.code_windows, 1024, seed=args.seed)
    return run_check(target, draft, tok, tasks, args.new_tokens, **extra)  # progress on stderr


if __name__ == "__main__":
    sys.exit(main())
