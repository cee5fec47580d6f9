"""Options shared by the command-line tools: which prompts to run, and clean error exits."""

from __future__ import annotations

import argparse
import sys

from .data.tasks import FAMILIES


def add_task_options(parser: argparse.ArgumentParser, prompts: int = 12, input_tokens: int = 2048,
                     task: str = "low") -> None:
    g = parser.add_argument_group("prompts")
    g.add_argument("--prompts", type=int, default=prompts, help="number of prompts")
    g.add_argument("--input-tokens", type=int, default=input_tokens, help="prompt length in tokens (built tasks)")
    g.add_argument("--task", default=task, help=f"task family: {', '.join(FAMILIES)}")
    g.add_argument("--source-dir", default=None,
                   help="build tasks from this folder of Python files (default: held-out standard library files)")
    g.add_argument("--data", default=None, help="a JSONL file of {'prompt', 'reference'} objects instead of built tasks")
    g.add_argument("--speedbench", default=None, help="a SPEED-Bench .jsonl/.parquet file instead of built tasks")
    g.add_argument("--category", default=None, help="with --speedbench: low_entropy, mixed or high_entropy (or low/high)")
    g.add_argument("--max-input-tokens", type=int, default=None, help="with --speedbench: skip longer prompts")
    g.add_argument("--seed", type=int, default=0, help="seed for task building")


def tasks_from_args(args, tokenizer, require_reference: bool = False):
    from .data.jsonl import load_jsonl
    from .data.tasks import build_tasks

    if args.prompts < 1:
        raise ValueError("--prompts must be >= 1")
    if args.data and args.speedbench:
        raise ValueError("give --data or --speedbench, not both")
    if args.data:
        return load_jsonl(args.data, require_reference=require_reference)[: args.prompts]
    if args.speedbench:
        from .data.speedbench import load_speedbench

        if require_reference:
            raise ValueError("SPEED-Bench rows carry no reference continuation; this command needs --data or built tasks")
        tasks = load_speedbench(args.speedbench, tokenizer, category=args.category, max_tokens=args.max_input_tokens)
        if not tasks:
            raise ValueError(f"no SPEED-Bench prompts left after filtering {args.speedbench!r}")
        return tasks[: args.prompts]
    return build_tasks(tokenizer, args.task, n=args.prompts, input_tokens=args.input_tokens, seed=args.seed,
                       source_dir=args.source_dir)


def require_positive(parser: argparse.ArgumentParser, args, names) -> None:
    """``parser.error`` (exit 2, one line) for any of ``names`` below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def fail(err: BaseException) -> int:
    """Print a one-line error (no traceback for bad input) and return the exit code."""
    print(f"error: {err}", file=sys.stderr)
    return 2
