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

``tokens_per_s`` is decode alone (prefill apart, as ``prefill_s``): what speculation speeds up. ``greedy_static`` is
plain greedy on ``rift_ada.static``'s static cache (eager), the greedy baseline without transformers' per-step cache
concatenation. With ``--compile`` it also holds the static and compiled paths (``*_compiled``: our loop drafting through the compiled static step of
``rift_ada.static``, and greedy ``generate`` on HF's static cache with ``torch.compile``), with ``draft_ms_per_step``
eager and compiled, compile times apart (``compile_s``) and dynamo's graph counts (``warmup_graphs``, and
``recompiles`` during the timed runs).

    python experiments/bench_decode.py --compile --lengths 1024 2048 4096 7168 8064 --prompts 1 --repeats 1
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
    p.add_argument("--compile", action="store_true",
                   help="also time the compiled paths: our loop drafting through the compiled static step "
                        "(rift_ada.static), and greedy generate on HF's static cache with torch.compile")
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
    """One input length's row: per-phase times of full and rift-stat, then end to end and decode alone on the same
    tokens."""
    from rift_ada.architectures import UnsupportedModelError
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
    ours, overhead, decode_s, dyn_rounds = {}, {}, {}, []
    for label, layout, ctrl in (("rift_ada_full", CacheLayout("full"), None),
                                ("rift_ada_dyn", CacheLayout("rift", args.budget), PeriodicController(args.period))):
        dec = SpeculativeDecoder.for_pair(pair, layout, Decoding(args.draft_length))
        runs = []
        for ids in prompts:
            runs.append(profile_decode(dec, ids, args.max_new_tokens, ctrl))
            if label == "rift_ada_dyn":
                dyn_rounds.append(dec.result)
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
    # (20 draft tokens, drafting stops when the draft's top probability < 0.4).
    hf = {name: timed(lambda k=k: [assisted_reference(pair.target, pair.draft, ids, args.max_new_tokens, k, eos)
                                   for ids in prompts])
          for name, k in (("hf_assisted", args.draft_length), ("hf_assisted_default", None))}
    _, t_draft_prefill = timed(lambda: [greedy_reference(pair.draft, ids, 1, eos) for ids in prompts])
    n_tok = sum(len(t) for t in plain)
    row["tokens_per_second"] = {**{k: n_tok / t for k, (_, t) in {**ours, **hf}.items()},
                                "target_greedy": n_tok / t_plain}
    row["same_output"] = {k: toks == plain for k, (toks, _) in {**ours, **hf}.items()}
    row["round_time"] = overhead
    after_first = n_tok - len(prompts)  # the first token comes with the prefill
    # Decode only: HF assisted less both models' one-token generate (their prefills).
    row["tokens_per_s"] = {"greedy": after_first / max(t_plain - t_prefill, 1e-9),
                           "full": after_first / decode_s["rift_ada_full"],
                           "rift_dyn": after_first / decode_s["rift_ada_dyn"],
                           "hf_assisted": after_first / max(hf["hf_assisted"][1] - t_prefill - t_draft_prefill, 1e-9)}
    try:
        static_greedy = [greedy_on_static_cache(pair.target, ids, args.max_new_tokens, eos) for ids in prompts]
        row["tokens_per_s"]["greedy_static"] = after_first / sum(t for _, t in static_greedy)
        row["same_output"]["greedy_static"] = [toks for toks, _ in static_greedy] == plain
    except UnsupportedModelError as e:  # a target rift_ada.static does not run: no such row
        print(f"note: no greedy_static row: {e}", file=sys.stderr)
    row["draft_ms_per_step"] = {"eager": draft_step_ms(dyn_rounds)}
    if args.compile:
        compiled = compiled_rows(pair, prompts, args, plain)
        row["tokens_per_s"].update(compiled.pop("tokens_per_s"))
        row["draft_ms_per_step"].update(compiled.pop("draft_ms_per_step"))
        row["same_output"].update(compiled.pop("same_output"))
        row.update(compiled)
    row["generate_vs_loop"] = row["tokens_per_second"]["rift_ada_dyn_generate"] / row["tokens_per_second"][
        "rift_ada_dyn_loop"]
    return row


@torch.inference_mode()
def greedy_on_static_cache(target, ids: list[int], new_tokens: int, eos: int | None) -> tuple[list[int], float]:
    """Plain greedy decoding of the target, one token per forward on ``rift_ada.static``'s static cache (eager): the
    greedy baseline without transformers' per-step cache concatenation. (tokens, decode seconds after the first
    token)."""
    from transformers import DynamicCache

    from rift_ada.static import StaticKV, StaticVerify

    x = torch.tensor([ids], device=target.device)
    cache = DynamicCache(config=target.config)
    token = int(target(x, cache=cache, logits_to_keep=1).logits[0, -1].argmax())
    cache, step, tokens = StaticKV(cache, len(ids) + new_tokens + 1), StaticVerify(target, 1), [token]
    t = time.perf_counter()
    while len(tokens) < new_tokens and token != eos:
        token = int(step(cache, [token])[-1].argmax())
        tokens.append(token)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - t


def verify_ms(results: list) -> float:
    rounds = [r for x in results for r in x.rounds]
    return 1000 * sum(r.verify_seconds for r in rounds) / max(len(rounds), 1)


def draft_step_ms(results: list) -> float:
    """Milliseconds per draft token over the rounds of ``results`` (``DecodeResult``s)."""
    rounds = [r for x in results for r in x.rounds]
    return 1000 * sum(r.draft_seconds for r in rounds) / max(sum(r.draft_length for r in rounds), 1)


def decode_rift_dyn(pair, args, step: str, ids: list[int], layout=None, max_new_tokens: int | None = None):
    from rift_ada.evaluate import decode
    from rift_ada.layout import CacheLayout
    from rift_ada.refresh import PeriodicController
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    rift = layout is None
    dec = SpeculativeDecoder.for_pair(pair, layout or CacheLayout("rift", args.budget),
                                      Decoding(args.draft_length, draft_step=step, verify_step=step))
    return decode(dec, ids, max_new_tokens or args.max_new_tokens, PeriodicController(args.period) if rift else None)


def compiled_rows(pair, prompts: list, args, plain: list) -> dict:
    """The static side: our loop with the draft step and the verify on static shapes (``rift_ada.static``), eager
    (``rift_dyn_static``) and compiled (rift-dyn; the full draft cache, whose shape holds for one prompt only), and
    plain greedy ``generate`` on HF's static cache with ``torch.compile``. Each compiled path is warmed up first on
    the same shapes (compile time, ``compile_s``, is never inside tokens/s); ``warmup_graphs`` counts the graphs
    each warm-up compiled (rift-dyn: its draft step's one graph at the first length only, and the verify's per
    length, since the target's cache holds the prompt), ``recompiles`` those compiled during the timed runs."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from rift_ada.layout import CacheLayout

    eos = pair.tokenizer.eos_token_id
    config = CompileConfig(mode="reduce-overhead" if pair.target.device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told

    def greedy(ids, n):
        x = torch.tensor([ids], device=pair.target.device)
        out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                   eos_token_id=eos, pad_token_id=eos, top_p=None, top_k=None, temperature=None,
                                   cache_implementation="static", compile_config=config)
        return out[0, len(ids):].tolist()

    full = CacheLayout("full")
    runs = {"rift_dyn": lambda ids, n=None: decode_rift_dyn(pair, args, "compiled", ids, max_new_tokens=n),
            "full": lambda ids, n=None: decode_rift_dyn(pair, args, "compiled", ids, full, n),
            "rift_dyn_static": lambda ids, n=None: decode_rift_dyn(pair, args, "static", ids, max_new_tokens=n)}
    compile_s, warmup_graphs, tokens, seconds, results = {}, {}, {}, {}, {}
    graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    timed_graphs = 0
    for label in runs:
        # Warm-up on the first prompt and the generation's max_new_tokens: the target's static cache (and a full
        # draft cache) is sized for them.
        if not label.endswith("_static"):  # eager: nothing to compile
            before = graphs()
            _, compile_s[label] = timed(lambda: runs[label](prompts[0]))
            warmup_graphs[label] = graphs() - before
        before = graphs()
        results[label] = [runs[label](ids) for ids in prompts]
        timed_graphs += graphs() - before
        tokens[label] = [r.tokens for r in results[label]]
        seconds[label] = sum(r.decode_seconds for r in results[label])
    before = graphs()
    _, compile_s["greedy"] = timed(lambda: greedy(prompts[0], args.max_new_tokens))
    warmup_graphs["greedy"] = graphs() - before
    before = graphs()
    tokens["greedy"], t_all = timed(lambda: [greedy(ids, args.max_new_tokens) for ids in prompts])
    _, t_one = timed(lambda: [greedy(ids, 1) for ids in prompts])
    timed_graphs += graphs() - before
    after_first = sum(len(t) for t in plain) - len(prompts)
    name = lambda k: k if k.endswith("_static") else f"{k}_compiled"  # noqa: E731
    return {"tokens_per_s": {"greedy_compiled": after_first / max(t_all - t_one, 1e-9),
                             **{name(k): after_first / seconds[k] for k in runs}},
            "draft_ms_per_step": {"compiled": draft_step_ms(results["rift_dyn"]),
                                  "static": draft_step_ms(results["rift_dyn_static"])},
            "verify_ms_per_round": {k: verify_ms(results[k]) for k in ("rift_dyn", "rift_dyn_static")},
            "same_output": {name(k): tokens[k] == plain for k in tokens},
            "compile_s": compile_s, "warmup_graphs": warmup_graphs, "recompiles": timed_graphs}


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
