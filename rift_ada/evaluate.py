"""Evaluate speculative decoding with a compressed draft cache.

    python -m rift_ada.evaluate --policy rift-dyn --budget 512 --period 64 --json

Prints acceptance length (AL, tokens per target step) overall and by generation quarter, refreshes, decode speed,
the draft's peak active KV bytes, for greedy decoding the share of prompts whose output equals the target's own
greedy ``generate``, and ``uncompressed_prompts``: prompts no longer than the budget, which the draft cache holds
whole after prefill (a note on stderr says so; full-cache comparisons are legitimate, so they are not refused).
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm.auto import tqdm

from .cli import ArgumentParser, add_runtime_options, add_task_options, apply_runtime, fail, tasks_from_args
from .policies import POLICIES, CachePolicy
from .scorers import SCORERS


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m rift_ada.evaluate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("models")
    m.add_argument("--target", default="testbed", help="'testbed', a local HF folder or a hub id")
    m.add_argument("--drafter", default="self",
                   help="'self' (the target drafts on a compressed cache), 'testbed' (the built-in draft), or a "
                        "local folder / hub id of a draft sharing the target's tokenizer")
    m.add_argument("--lora", default=None,
                   help="a LoRA adapter folder (experiments/train_compressibility.py) applied to the drafter; with "
                        "--drafter self the adapted copy drafts and the unadapted target verifies")
    m.add_argument("--lora-merge", action="store_true", help="merge the adapter into the drafter's weights")
    c = p.add_argument_group("draft cache")
    c.add_argument("--policy", default="rift-stat", help=f"one of: {', '.join(POLICIES)}")
    c.add_argument("--budget", type=int, default=512, help="active draft KV budget in tokens")
    c.add_argument("--window-fraction", type=float, default=0.5, help="share of the budget for the sliding window")
    c.add_argument("--window", type=int, default=None, help="sliding window in tokens (overrides the fraction)")
    c.add_argument("--sinks", type=int, default=4, help="attention sinks kept by the 'window' policy")
    c.add_argument("--period", type=int, default=None, help="rift-dyn: generated tokens between refreshes")
    c.add_argument("--controller", default=None,
                   help="rift-ada: an exported controller file (controller.json / controller.pt) deciding refreshes")
    c.add_argument("--scorer", default="snapkv", help=f"one of: {', '.join(SCORERS)}")
    c.add_argument("--obs-window", type=int, default=32, help="observation queries used for scoring")
    c.add_argument("--kernel", type=int, default=7, help="snapkv pooling kernel")
    c.add_argument("--lookahead", type=int, default=CachePolicy.lookahead,
                   help="extend snapkv scores this many tokens forward (0 = plain SnapKV)")
    c.add_argument("--pooling", default="max", help="snapkv pooling: max, avg or none")
    c.add_argument("--store-device", default=None, help="device of the backing store (default: the model's)")
    d = p.add_argument_group("decoding")
    d.add_argument("--draft-length", type=int, default=11, help="draft tokens per round (k)")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--no-greedy-check", action="store_true",
                   help="skip the comparison with the target's own greedy generate (saves one decode per prompt)")
    add_task_options(p, prompts=4, input_tokens=2048, task="low")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--per-prompt", action="store_true", help="include per-prompt rows")
    add_runtime_options(p)
    return p


def policy_from_args(args) -> CachePolicy:
    return CachePolicy(args.policy, budget=None if args.policy == "full" else args.budget,
                       window_fraction=args.window_fraction, window=args.window, sinks=args.sinks,
                       period=args.period, scorer=args.scorer, obs_window=args.obs_window, lookahead=args.lookahead,
                       scorer_options={"kernel": args.kernel, "pooling": args.pooling})


def run(args) -> dict:
    # Options and small files first: bad input fails before transformers is imported and models load.
    policy = policy_from_args(args)
    decide = None
    if args.policy == "rift-ada":
        if not args.controller:
            raise ValueError("--policy rift-ada needs --controller FILE (e.g. runs/controller/controller.json)")
        from controllers.export import load_controller

        from .signals import decider

        decide = decider(load_controller(args.controller))
    elif args.controller:
        raise ValueError("--controller only applies to --policy rift-ada")
    if args.lora:
        from .lora import check_adapter

        check_adapter(args.lora)  # a broken adapter folder fails before the models load
    elif args.lora_merge:
        raise ValueError("--lora-merge needs --lora DIR")
    from .data import encode
    from .metrics import acceptance_length, summarize
    from .models import load_pair
    from .speculative import SpeculativeDecoder
    from .testbed.check import greedy_continuation

    pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype)
    tasks = tasks_from_args(args, pair.tokenizer)
    eos = pair.tokenizer.eos_token_id
    draft = None if pair.self_speculative else pair.draft
    if args.lora:
        from .lora import load_drafter

        draft = load_drafter(pair.draft, args.lora, merge=args.lora_merge)
    dec = SpeculativeDecoder(pair.target, draft, policy,
                             draft_length=args.draft_length, temperature=args.temperature, top_p=args.top_p,
                             eos_token_id=eos, seed=args.seed, store_device=args.store_device)
    greedy_check = args.temperature == 0 and not args.no_greedy_check
    prompts = [encode(pair.tokenizer, task.prompt) for task in tasks]
    whole = [len(ids) for ids in prompts if policy.budget is None or len(ids) <= policy.budget]
    if whole and policy.budget is not None:
        print(f"note: budget {policy.budget} >= prompt length for {len(whole)} of {len(prompts)} prompts (up to "
              f"{max(whole)} tokens): the draft cache holds them whole, prefill compresses nothing", file=sys.stderr)
    results, rows, matches = [], [], []
    for task, ids in tqdm(list(zip(tasks, prompts)), desc=f"{args.policy} (budget {args.budget})", disable=args.json):
        res = dec.generate(ids, args.max_new_tokens, decide)
        results.append(res)
        row = {"task_id": task.task_id, "prompt_tokens": len(ids), "acceptance_length": acceptance_length(res.rounds),
               "refreshes": res.refreshes, "generated_tokens": len(res.tokens)}
        if greedy_check:
            matches.append(greedy_continuation(pair.target, ids, args.max_new_tokens, eos) == res.tokens)
            row["target_greedy_match"] = matches[-1]
        rows.append(row)
    out = {"policy": policy.name, "budget": policy.budget, "drafter": args.drafter, "target": args.target,
           "draft_length": args.draft_length, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
    out.update(summarize(results, args.max_new_tokens))
    out["target_greedy_match"] = sum(matches) / len(matches) if matches else None
    out["uncompressed_prompts"] = len(whole)
    if args.per_prompt:
        out["per_prompt"] = rows
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        apply_runtime(args)
        if args.json:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        out = run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if k != "per_prompt":
                print(f"{k:>30}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
