"""Decode benchmark: the draft's memory and step time versus context length, and throughput against HF.

    python experiments/bench_decode.py                     # testbed, 1K/2K/4K prompts, budget 512
    python experiments/bench_decode.py --target Qwen/Qwen3-8B --drafter Qwen/Qwen3-0.6B --device cuda --lengths 8192 32768

For each prompt length it decodes the same prompts with a full draft cache and with RIFT (rift-stat) and reports the
draft's peak active KV bytes and its time per draft forward. It then compares end-to-end tokens/s of rift-ada's
speculative loop (external drafter; full draft cache, and rift-dyn) with HF assisted generation
(`generate(assistant_model=...)`: fixed 11 draft tokens and no confidence stop, and HF's defaults), with plain greedy
`generate`, and rift-dyn through `generate(custom_generate=rift_generate)` beside the same loop run without profiling
(``generate_vs_loop``: the ratio of their tokens/s),
checking that all of them produce the same tokens. Our loops are profiled as they run (``rift_ada.profiling``):
``round_time`` splits their round time into model forwards, rescoring and the framework's overhead (the rest).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from rift_ada.cli import (ArgumentParser, add_model_options, add_runtime_options, apply_runtime, check_output, fail,
                          require_positive, write_output)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed", device_map=True)  # an external draft: HF assisted generation needs one
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths in tokens")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--period", type=int, default=32, help="rift-dyn refresh period in the end-to-end comparison")
    p.add_argument("--draft-length", type=int, default=11)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per prompt of the generate-path comparison (the fastest counts)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    add_runtime_options(p)
    args = p.parse_args(argv)
    require_positive(p, args, ("budget", "period", "draft_length", "max_new_tokens", "prompts", "repeats"))
    if min(args.lengths) < 1:
        p.error("--lengths must be >= 1")
    if args.drafter == "self":
        p.error("--drafter must be an external draft model (HF assisted generation needs one)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        apply_runtime(args)
        check_output(args.output)
        # Imported after the option checks, so bad options fail without importing transformers.
        from rift_ada.data import build_tasks, encode
        from rift_ada.models import load_pair

        pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype, device_map=args.device_map)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # ModelLoadError is a RuntimeError
        return fail(e)
    report = {"budget": args.budget, "draft_length": args.draft_length, "device": args.device,
              "threads": args.threads, "lengths": []}
    for length in args.lengths:
        try:
            tasks = build_tasks(pair.tokenizer, "low", n=args.prompts, input_tokens=length, seed=0)
        except ValueError as e:
            return fail(e)
        row = bench_length(pair, length, [encode(pair.tokenizer, t.prompt) for t in tasks], args)
        report["lengths"].append(row)
        print(json.dumps(row), file=sys.stderr)

    print(json.dumps(report, indent=1))
    write_output(args.output, report)
    return 0


def bench_length(pair, length: int, prompts: list, args) -> dict:
    """One input length's row: per-phase times of full and rift-stat, then end to end on the same tokens."""
    from rift_ada.evaluate import evaluate
    from rift_ada.layout import CacheLayout
    from rift_ada.models import assisted_reference, greedy_reference
    from rift_ada.profiling import profile_decode
    from rift_ada.refresh import PeriodicController
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    eos = pair.tokenizer.eos_token_id
    row = {"input_tokens": length}
    for name, layout in (("full", CacheLayout("full")), ("rift-stat", CacheLayout("rift", args.budget, store=False))):
        dec = SpeculativeDecoder.for_pair(pair, layout, Decoding(args.draft_length))
        ev = evaluate(dec, prompts, None, args.max_new_tokens)
        rounds = [r for x in ev.results for r in x.rounds]
        steps = sum(r.draft_length for r in rounds)
        row[name] = {
            "draft_ms_per_step": 1000 * sum(r.draft_seconds for r in rounds) / max(steps, 1),
            "verify_ms_per_round": 1000 * sum(r.verify_seconds for r in rounds) / max(len(rounds), 1),
            "draft_active_kv_bytes": ev.summary["draft_active_kv_bytes"],
            "acceptance_length": ev.summary["acceptance_length"],
        }

    # End-to-end, same tokens: rift-ada's loop with a full draft cache (HF's setting) and with rift-dyn, HF
    # assisted generation, plain greedy decoding.
    # Our loops are profiled as they run: the share of round time outside model forwards and rescoring is the
    # framework's overhead.
    ours, overhead, decode_s = {}, {}, {}
    for label, layout, ctrl in (("rift_ada_full", CacheLayout("full"), None),
                                ("rift_ada_dyn", CacheLayout("rift", args.budget), PeriodicController(args.period))):
        dec = SpeculativeDecoder.for_pair(pair, layout, Decoding(args.draft_length))
        runs = [profile_decode(dec, ids, args.max_new_tokens, ctrl) for ids in prompts]
        ours[label] = [r.tokens for r in runs], sum(r.seconds for r in runs)
        step = sum(r.step_seconds for r in runs)
        decode_s[label] = step
        overhead[label] = {"round_seconds": step, "forward_share": sum(r.forward_seconds for r in runs) / step,
                           "refresh_share": sum(r.refresh_seconds for r in runs) / step,
                           "overhead_share": sum(r.overhead_seconds for r in runs) / step}
    plain, t_plain = timed(lambda: [greedy_reference(pair.target, ids, args.max_new_tokens, eos)
                                    for ids in prompts])
    ours.update(generate_path(pair, prompts, args))
    # Decode alone, what speculation speeds up: our loops' rounds, and greedy's time less a one-token generate (the
    # prompt's forward and the first token), which is the target's prefill.
    _, t_prefill = timed(lambda: [greedy_reference(pair.target, ids, 1, eos) for ids in prompts])
    row["prefill_s"] = t_prefill / len(prompts)

    # HF assisted generation: with our setting (k draft tokens a round, no confidence stop) and with its defaults
    # (20 tokens, drafting stops when the draft's top probability < 0.4).
    hf = {name: timed(lambda k=k: [assisted_reference(pair.target, pair.draft, ids, args.max_new_tokens, k, eos)
                                   for ids in prompts])
          for name, k in (("hf_assisted", args.draft_length), ("hf_assisted_default", None))}
    n_tok = sum(len(t) for t in plain)
    row["tokens_per_second"] = {**{k: n_tok / t for k, (_, t) in {**ours, **hf}.items()},
                                "target_greedy": n_tok / t_plain}
    row["same_output"] = {k: toks == plain for k, (toks, _) in {**ours, **hf}.items()}
    row["round_time"] = overhead
    after_first = n_tok - len(prompts)  # the first token comes with the prefill
    row["decode_tokens_per_second"] = {"greedy": after_first / max(t_plain - t_prefill, 1e-9),
                                       **{k: after_first / t for k, t in decode_s.items()}}
    row["generate_vs_loop"] = row["tokens_per_second"]["rift_ada_dyn_generate"] / row["tokens_per_second"][
        "rift_ada_dyn_loop"]
    return row


def generate_path(pair, prompts: list, args) -> dict:
    """rift-dyn through ``target.generate(custom_generate=rift_generate)`` and through our loop (``decode``, no
    profiling hooks), alternating per prompt so both see the same machine, each prompt's time the fastest of
    ``--repeats`` runs (another job's bursts only ever slow a run down): {label: (tokens, seconds)}."""
    from rift_ada.evaluate import decode
    from rift_ada.hf import rift_generate
    from rift_ada.layout import CacheLayout
    from rift_ada.refresh import PeriodicController
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    eos = pair.tokenizer.eos_token_id

    def loop(ids):
        dec = SpeculativeDecoder.for_pair(pair, CacheLayout("rift", args.budget), Decoding(args.draft_length))
        return decode(dec, ids, args.max_new_tokens, PeriodicController(args.period)).tokens

    def generate(ids):
        x = torch.tensor([ids], device=pair.target.device)
        out = pair.target.generate(
            x, attention_mask=torch.ones_like(x), assistant_model=pair.draft, max_new_tokens=args.max_new_tokens,
            do_sample=False, eos_token_id=eos, pad_token_id=eos, custom_generate=rift_generate, rift_policy="rift-dyn",
            rift_budget=args.budget, rift_period=args.period, rift_draft_length=args.draft_length)
        return out[0, len(ids):].tolist()

    out = {}
    for ids in prompts:
        best = {}
        for _ in range(args.repeats):
            for label, fn in (("rift_ada_dyn_loop", loop), ("rift_ada_dyn_generate", generate)):
                tokens, t = timed(lambda: fn(ids))
                best[label] = (tokens, min(t, best.get(label, (None, float("inf")))[1]))
        for label, (tokens, t) in best.items():
            toks, total = out.get(label, ([], 0.0))
            out[label] = toks + [tokens], total + t
    return out


if __name__ == "__main__":
    sys.exit(main())
