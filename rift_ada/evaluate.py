"""Evaluate speculative decoding with a compressed draft cache.

    python -m rift_ada.evaluate --policy rift-dyn --budget 512 --period 64 --json

Prints acceptance length (AL, tokens per target step) overall and by generation quarter, refreshes, decode speed,
the draft's peak active KV bytes, for greedy decoding the share of prompts whose output equals the target's own
greedy ``generate``, and ``uncompressed_prompts``: prompts no longer than the budget, which the draft cache holds
whole after prefill (a note on stderr says so; full-cache comparisons are legitimate, so they are not refused).

In Python, ``evaluate(decoder, prompts, controller)`` is the same run on a decoder you built; the policy table, the
benchmark and the trainers call it. ``decode(decoder, prompt, max_new_tokens, controller)`` is one prompt's decode:
the decoder's loop (``SpeculativeDecoder.rounds``) with the controller deciding each round's refresh.

Data parallel: ``torchrun --nproc-per-node N -m rift_ada.evaluate ...`` splits the prompts across N processes (each on
cuda:LOCAL_RANK with --device cuda); rank 0 prints what one process would, timings aside (rift_ada.distributed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from tqdm.auto import tqdm

from . import distributed
from .cli import (ArgumentParser, add_cache_options, add_decoding_options, add_model_options, add_runtime_options,
                  add_task_options, apply_runtime, decoding_from_args, fail_in_group, policy_from_args,
                  tasks_from_args)
from .joint.control import check_joint, is_joint
from .metrics import acceptance_length, summarize
from .refresh.base import refresh_wanted

if TYPE_CHECKING:  # imported when used: bad options fail before torch and transformers load
    from .speculative import DecodeResult, SpeculativeDecoder


@dataclass
class Evaluation:
    results: list[DecodeResult]  # one per prompt, with every round's record
    summary: dict  # rift_ada.metrics.summarize, plus target_greedy_match
    rows: list[dict] = field(default_factory=list)  # per prompt: AL, refreshes, tokens (and the greedy match)


def greedy_references(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None = None,
                      progress: bool | str = False) -> list[list[int]]:
    """The target's own greedy output for each prompt (``models.greedy_reference``): ``evaluate(references=...)``."""
    from .models import greedy_reference

    desc = progress if isinstance(progress, str) else "greedy references"
    return [greedy_reference(target, list(ids), max_new_tokens, eos_token_id)
            for ids in tqdm(prompts, desc=desc, disable=not progress)]


def decode(decoder: SpeculativeDecoder, prompt_ids: Sequence[int], max_new_tokens: int,
           controller=None, on_tokens=None) -> DecodeResult:
    """Decode one prompt to the end, ``controller`` (``rift_ada.refresh``) deciding each round's refresh from the
    signals (None: never refresh), or a joint controller (``rift_ada.joint``) each round's refresh and draft length. ``on_tokens(new_tokens) -> bool``, if given, sees the first token and then each
    round's new tokens, and ends the decode by returning True (``rift_ada.hf``: streamers, stopping criteria).
    The rounds are the decoder's own loop, ``SpeculativeDecoder.rounds``."""
    decoder.reset(prompt_ids, max_new_tokens)
    if on_tokens is not None and on_tokens(decoder.result.tokens):
        return decoder.result
    tokens = decoder.result.tokens
    decide = (check_joint(controller, decoder).act if is_joint(controller)
              else (lambda state: refresh_wanted(controller, state)))
    for record in decoder.rounds(decide):
        if on_tokens is not None and on_tokens(tokens[len(tokens) - record.emitted:]):
            break
    return decoder.result


def evaluate(decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], controller=None,
             max_new_tokens: int = 256, greedy_check: bool = False, progress: bool | str = False,
             references: Sequence[Sequence[int]] | None = None) -> Evaluation:
    """Decode every prompt with ``decoder``; ``controller`` (``rift_ada.refresh``) decides refreshes, None never.
    ``greedy_check`` compares each output with the target's own greedy ``generate`` (greedy decoding only);
    ``references``, one per prompt, are those outputs computed once (``greedy_references``) for several evaluations
    of one target, where a long prompt's reference costs as much as a decode.

    Under torchrun, once ``rift_ada.distributed.init`` has joined the process group, each process decodes its shard
    of ``prompts`` (every process must call this with the same prompts and settings) and every process returns the
    whole Evaluation, in prompt order: the same as one process's, timings aside. Only rank 0 shows progress."""
    from .models import greedy_reference

    if greedy_check and decoder.temperature != 0:
        raise ValueError("the greedy check needs temperature 0")
    if references is not None and len(references) != len(prompts):
        raise ValueError(f"{len(references)} greedy references for {len(prompts)} prompts")
    desc = progress if isinstance(progress, str) else "evaluate"
    decoded = []  # (prompt index, (result, row)) for this process's shard: all prompts in a single process
    for i, ids in tqdm(distributed.shard(prompts), desc=desc, disable=not progress or not distributed.is_main()):
        with distributed.on_shard(i):
            res = decode(decoder, ids, max_new_tokens, controller)
            ref = None if not greedy_check else (
                list(references[i]) if references is not None
                else greedy_reference(decoder.target, list(ids), max_new_tokens, decoder.eos_token_id))
            row = prompt_row(i, ids, res, ref)
        decoded.append((i, (res, row)))
    gathered = distributed.gather(decoded)  # every process's shard, in prompt order
    return evaluation([res for res, _ in gathered], [row for _, row in gathered], max_new_tokens, greedy_check)


def prompt_row(i: int, ids, res, reference: list[int] | None = None) -> dict:
    """One prompt's row of an Evaluation; with the target's own greedy ``reference``, whether the output equals it."""
    row = {"prompt": i, "prompt_tokens": len(ids), "acceptance_length": acceptance_length(res.rounds),
           "refreshes": res.refreshes, "generated_tokens": len(res.tokens)}
    if reference is not None:
        row["target_greedy_match"] = reference == res.tokens
    return row


def evaluation(results: list, rows: list[dict], max_new_tokens: int, greedy_check: bool) -> Evaluation:
    """The Evaluation of these results and their rows: the summary, with the share of greedy matches."""
    summary = summarize(results, max_new_tokens)
    matches = [row["target_greedy_match"] for row in rows] if greedy_check else []
    summary["target_greedy_match"] = sum(matches) / len(matches) if matches else None
    return Evaluation(results, summary, rows)


def evaluate_batched(decoder, prompts: Sequence[Sequence[int]], controller=None, max_new_tokens: int = 256,
                     batch_size: int = 8, greedy_check: bool = False, progress: bool | str = False) -> Evaluation:
    """``evaluate`` with a ``rift_ada.batch.BatchDecoder``: the prompts in batches of ``batch_size`` (the last one
    smaller), each row refreshing as ``controller`` decides from its own state. The same summary and rows."""
    from .batch import decide_rows, joint_rows
    from .models import greedy_reference

    if greedy_check and decoder.temperature != 0:
        raise ValueError("the greedy check needs temperature 0")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    decide = ((lambda states: joint_rows(controller, states)) if is_joint(controller)  # each row's refresh, one k
              else (lambda states: (decide_rows(controller, states), None)))
    results, rows = [], []
    desc = progress if isinstance(progress, str) else "evaluate"
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress):
        chunk = [list(p) for p in prompts[start:start + batch_size]]
        decoder.reset(chunk, max_new_tokens)
        while not decoder.done:
            decoder.step(*decide(decoder.states))
        for j, (ids, res) in enumerate(zip(chunk, decoder.results)):
            ref = (greedy_reference(decoder.target, ids, max_new_tokens, decoder.eos_token_id) if greedy_check
                   else None)
            results.append(res)
            rows.append(prompt_row(start + j, ids, res, ref))
    ev = evaluation(results, rows, max_new_tokens, greedy_check)
    ev.summary["batch_size"] = batch_size
    return ev


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m rift_ada.evaluate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, device_map=True)
    p.add_argument("--draft-adapter", "--lora", dest="lora", default=None, metavar="DIR",
                   help="a LoRA adapter folder (experiments/train_compressibility.py) applied to the drafter; with "
                        "--drafter self the adapter lives in the target's own weights, on in the draft passes and off "
                        "in the verify (no second copy of the model)")
    p.add_argument("--lora-merge", action="store_true",
                   help="merge the adapter into a copy of an external drafter's weights")
    add_cache_options(p)
    p.add_argument("--store-device", default=None, help="device of the backing store (default: the model's)")
    add_decoding_options(p)
    p.add_argument("--batch-size", type=int, default=1,
                   help="decode this many prompts at once (rift_ada.batch: one RIFT draft cache and refresh schedule "
                        "per row; model steps only)")
    p.add_argument("--no-greedy-check", action="store_true",
                   help="skip the comparison with the target's own greedy generate (saves one decode per prompt)")
    add_task_options(p, prompts=4, input_tokens=2048, task="low")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--per-prompt", action="store_true", help="include per-prompt rows")
    add_runtime_options(p)
    return p


def run(args) -> dict:
    # Options and small files first: bad input fails before transformers is imported and models load.
    policy = policy_from_args(args)
    if args.lora:
        from .lora import check_adapter

        check_adapter(args.lora)  # a broken adapter folder fails before the models load
    elif args.lora_merge:
        raise ValueError("--lora-merge needs --draft-adapter DIR")
    if args.lora_merge and args.drafter == "self":
        raise ValueError("--lora-merge would fold the adapter into the target itself: a self-drafter keeps it "
                         "switchable (on while drafting, off in the verify); drop --lora-merge")
    from .data import encode
    from .models import load_pair
    from .speculative import SpeculativeDecoder

    pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype, device_map=args.device_map)
    tasks = tasks_from_args(args, pair.tokenizer)
    draft = None
    if args.lora:
        from .lora import load_drafter, load_self_drafter

        draft = load_self_drafter(pair.target, args.lora) if pair.self_speculative else \
            load_drafter(pair.draft, args.lora, merge=args.lora_merge)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.batch_size > 1:
        from .batch import BatchDecoder

        dec = BatchDecoder.for_pair(pair, policy.layout, decoding_from_args(args), draft,
                                    store_device=args.store_device)
        if is_joint(policy.controller):
            check_joint(policy.controller, dec.template)
    else:
        dec = SpeculativeDecoder.for_pair(pair, policy.layout, decoding_from_args(args), draft,
                                          store_device=args.store_device)
    prompts = [encode(pair.tokenizer, task.prompt) for task in tasks]
    budget = policy.layout.budget
    whole = [len(ids) for ids in prompts if budget is None or len(ids) <= budget]
    if whole and budget is not None and distributed.is_main():
        print(f"note: budget {budget} >= prompt length for {len(whole)} of {len(prompts)} prompts (up to "
              f"{max(whole)} tokens): the draft cache holds them whole, prefill compresses nothing", file=sys.stderr)
    if args.batch_size == 1 and "compiled" in (dec.draft_step, dec.verify_step) and distributed.is_main():
        print("note: compiled steps compile during the first prompt (and the verify at each new prompt length), "
              "inside tokens_per_second; experiments/bench_decode.py --compile times them apart", file=sys.stderr)
    check = args.temperature == 0 and not args.no_greedy_check
    bar = False if args.json else f"{args.policy} (budget {args.budget})"
    ev = (evaluate_batched(dec, prompts, policy.controller, args.max_new_tokens, args.batch_size, check, bar)
          if args.batch_size > 1 else evaluate(dec, prompts, policy.controller, args.max_new_tokens,
                                               greedy_check=check, progress=bar))
    out = {"policy": policy.name, "budget": budget, "drafter": args.drafter, "target": args.target,
           "draft_length": args.draft_length, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
           **ev.summary, "uncompressed_prompts": len(whole)}
    if args.per_prompt:
        out["per_prompt"] = [{"task_id": t.task_id, **row} for t, row in zip(tasks, ev.rows)]
    return out


def main(argv=None) -> int:
    if distributed.is_main():
        args = build_parser().parse_args(argv)
    else:  # under torchrun every process parses the same options: rank 0 alone prints --help or a usage error
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = build_parser().parse_args(argv)
    try:
        with distributed.leaving():
            apply_runtime(args)
            # Under torchrun: this process's device (cuda -> cuda:LOCAL_RANK) and the process group; no-ops otherwise.
            args.device = distributed.local_device(args.device)
            distributed.init(args.device)
            if args.json or not distributed.is_main():
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            out = run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail_in_group(e)
    if not distributed.is_main():
        return 0
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if k != "per_prompt":
                print(f"{k:>30}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
