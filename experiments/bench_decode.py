"""Decode benchmark: the draft's memory and step time versus context length, and throughput against HF.

    python experiments/bench_decode.py                     # testbed, 1K/2K/4K prompts, budget 512
    python experiments/bench_decode.py --target Qwen/Qwen3-8B --drafter Qwen/Qwen3-0.6B --device cuda --lengths 8192 32768

For each prompt length it decodes the same prompts with a full draft cache and with RIFT (rift-stat) and reports the
draft's peak active KV bytes and its time per draft forward. It then compares end-to-end tokens/s of rift-ada's
speculative loop (external drafter; full draft cache, and rift-dyn) with HF assisted generation
(`generate(assistant_model=...)`: fixed 11 draft tokens and no confidence stop, and HF's defaults), with plain greedy
`generate`, and rift-dyn through `generate(custom_generate=rift_generate)` beside the same loop run without profiling
(``generate_vs_loop``: the ratio of their tokens/s), checking that all of them produce the same tokens. Our loops are
profiled as they run (``rift_ada.profiling``): ``round_time`` splits their round time into model forwards, rescoring
and the framework's overhead (the rest).

``tokens_per_s`` is decode alone (prefill apart, as ``prefill_s``): what speculation speeds up. ``greedy_static`` is
plain greedy on ``rift_ada.static``'s static cache (eager), the greedy baseline without transformers' per-step cache
concatenation. With ``--compile`` it also holds the static and compiled paths (``*_compiled``: our loop drafting
through the compiled static step of ``rift_ada.static``, and greedy ``generate`` on HF's static cache with
``torch.compile``), with ``draft_ms_per_step`` eager and compiled, compile times apart (``compile_s``) and dynamo's
graph counts (``warmup_graphs``, and ``recompiles`` during the timed runs).

    python experiments/bench_decode.py --compile --lengths 1024 2048 4096 7168 8064 --prompts 1 --repeats 1

``--batch-sizes`` runs the batched rows instead (``rift_ada.studies.batch_bench``: batched greedy, full-cache and
rift-dyn speculation, the draft's KV, the round's split, the round costs ``gpu_check.py --model-from`` reads):

    python experiments/bench_decode.py --batch-sizes 1 4 8 16 --lengths 4096 --max-new-tokens 128

``--controller FILE`` (a joint controller: ``train_controller.py --joint``) runs only its rows instead, per length and
task family: plain decoding, the best fixed (k, period), the context-length k table and the controller, decode only
(``rift_ada.studies.joint_bench``):

    python experiments/bench_decode.py --controller runs/joint/controller-joint-ppo.pt --source-dir pip \
        --lengths 1024 4096 7168 --prompts 2 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import sys

from rift_ada.studies.decode_bench import (add_benchmark_options, compiled_graphs, compiled_greedy, draft_ms_per_step, generate_path,
                            plain_decode, prepare_run, time_hf_assisted, timed, verify_ms_per_round, warm_up)
from rift_ada.cli import ArgumentParser, add_model_options, add_runtime_options, fail, require_positive, write_output
from rift_ada.studies.joint_bench import add_controller_options, check_controller_args
from rift_ada.studies.batch_bench import add_batch_options, check_batch_options


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed", device_map=True)  # an external draft: HF assisted generation needs one
    add_benchmark_options(p, lengths=[1024, 2048, 4096], lengths_help="prompt lengths in tokens", budget=512,
                          budget_help=None, max_new_tokens=128,
                          compile_help="also time the compiled paths: our loop drafting through the compiled static "
                                       "step (rift_ada.static), and greedy generate on HF's static cache with "
                                       "torch.compile")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per prompt of the generate-path comparison (the fastest counts)")
    add_batch_options(p)
    add_controller_options(p)
    add_runtime_options(p)
    args = p.parse_args(argv)
    check_batch_options(p, args)
    require_positive(p, args, ("budget", "period", "draft_length", "max_new_tokens", "prompts", "repeats"))
    if min(args.lengths) < 1:
        p.error("--lengths must be >= 1")
    if args.drafter == "self":
        p.error("--drafter must be an external draft model (HF assisted generation needs one)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        args.policies = prepare_run(args)
        check_controller_args(args)
        # Imported after the option checks, so bad options fail without importing transformers.
        from rift_ada.data import build_tasks, encode
        from rift_ada.models import load_pair

        pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype, device_map=args.device_map)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # ModelLoadError is a RuntimeError
        return fail(e)
    report = {"budget": args.budget, "draft_length": args.draft_length, "device": args.device,
              "threads": args.threads, "lengths": []}
    if args.controller:
        from rift_ada.studies.joint_bench import bench_controller, controller_report

        report = controller_report(args)
    if args.batch_sizes:
        from rift_ada.studies.batch_bench import batch_report

        try:
            report = batch_report(pair, args, report)
        except ValueError as e:
            return fail(e)
    for length in [] if args.batch_sizes else args.lengths:
        try:
            tasks = {f: build_tasks(pair.tokenizer, f, n=args.prompts, input_tokens=length, seed=args.seed,
                                    source_dir=args.source) for f in args.families}
        except ValueError as e:
            return fail(e)
        prompts = {f: [encode(pair.tokenizer, t.prompt) for t in ts] for f, ts in tasks.items()}
        row = ({"input_tokens": length, **bench_controller(pair, args.controller, prompts, args)} if args.controller
               else bench_length(pair, length, prompts["low"], args))
        report["lengths"].append(row)
        print(json.dumps(row), file=sys.stderr)
    print(json.dumps(report, indent=1))
    write_output(args.output, report)
    return 0


def bench_length(pair, length: int, prompts: list, args) -> dict:
    """One input length's row: per-phase times of full and rift-stat, then end to end and decode alone (same tokens)."""
    from rift_ada.architectures import UnsupportedModelError
    from rift_ada.models import greedy_reference

    eos = pair.tokenizer.eos_token_id
    row = {"input_tokens": length, **phase_times(pair, prompts, args)}
    # End-to-end, same tokens: rift-ada's loop with a full draft cache (HF's setting) and with rift-dyn, HF
    # assisted generation, plain greedy decoding.
    ours, round_time, dyn_results = profiled_loops(pair, prompts, args)
    plain, t_plain = timed(lambda: [greedy_reference(pair.target, ids, args.max_new_tokens, eos) for ids in prompts])
    ours.update(generate_path(pair, prompts, args, decoder(pair, args.policies["rift-dyn"], args)))
    # Decode alone, what speculation speeds up: our loops' rounds, and greedy's time less a one-token generate (the
    # prompt's forward and the first token), which is the target's prefill.
    _, t_prefill = timed(lambda: [greedy_reference(pair.target, ids, 1, eos) for ids in prompts])
    row["prefill_s"] = t_prefill / len(prompts)
    hf = time_hf_assisted(pair.target, pair.draft, prompts, args.max_new_tokens, args.draft_length, eos)
    _, t_draft_prefill = timed(lambda: [greedy_reference(pair.draft, ids, 1, eos) for ids in prompts])
    n_tok = sum(len(t) for t in plain)
    row["tokens_per_second"] = {**{k: n_tok / t for k, (_, t) in {**ours, **hf}.items()},
                                "target_greedy": n_tok / t_plain}
    row["same_output"] = {k: toks == plain for k, (toks, _) in {**ours, **hf}.items()}
    row["round_time"] = round_time
    after_first = n_tok - len(prompts)  # the first token comes with the prefill
    # Decode only: HF assisted less both models' one-token generate (their prefills).
    row["tokens_per_s"] = {"greedy": after_first / max(t_plain - t_prefill, 1e-9),
                           "full": after_first / round_time["rift_ada_full"]["round_seconds"],
                           "rift_dyn": after_first / round_time["rift_ada_dyn"]["round_seconds"],
                           "hf_assisted": after_first / max(hf["hf_assisted"][1] - t_prefill - t_draft_prefill, 1e-9)}
    try:
        static_greedy = [plain_decode(pair.target, ids, args.max_new_tokens, eos) for ids in prompts]
        row["tokens_per_s"]["greedy_static"] = after_first / sum(t for _, t in static_greedy)
        row["same_output"]["greedy_static"] = [toks for toks, _ in static_greedy] == plain
    except UnsupportedModelError as e:  # a target rift_ada.static does not run: no such row
        print(f"note: no greedy_static row: {e}", file=sys.stderr)
    row["draft_ms_per_step"] = {"eager": draft_ms_per_step(dyn_results)}
    if args.compile:
        compiled = compiled_rows(pair, prompts, args, plain)
        for key in ("tokens_per_s", "draft_ms_per_step", "same_output"):
            row[key].update(compiled.pop(key))
        row.update(compiled)
    row["generate_vs_loop"] = row["tokens_per_second"]["rift_ada_dyn_generate"] / row["tokens_per_second"][
        "rift_ada_dyn_loop"]
    return row


def decoder(pair, policy, args, step: str = "model"):
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    return SpeculativeDecoder.for_pair(pair, policy.layout, Decoding(args.draft_length, draft_step=step,
                                                                     verify_step=step))


def phase_times(pair, prompts: list, args) -> dict:
    """Per phase (the round records), with a full draft cache and with rift-stat; the draft's peak active KV."""
    from rift_ada.evaluate import evaluate

    rows = {}
    for name in ("full", "rift-stat"):
        ev = evaluate(decoder(pair, args.policies[name], args), prompts, None, args.max_new_tokens)
        rows[name] = {"draft_ms_per_step": draft_ms_per_step(ev.results),
                      "verify_ms_per_round": verify_ms_per_round(ev.results),
                      "draft_active_kv_bytes": ev.summary["draft_active_kv_bytes"],
                      "acceptance_length": ev.summary["acceptance_length"]}
    return rows


def profiled_loops(pair, prompts: list, args) -> tuple[dict, dict, list]:
    """rift-ada's loop with a full draft cache and with rift-dyn, profiled as it runs (time outside model forwards and
    rescoring is the framework's overhead): {label: (tokens, seconds)}, {label: time split}, rift-dyn's results."""
    from rift_ada.profiling import profile_decode

    ours, split, dyn_results = {}, {}, []
    for label, policy in (("rift_ada_full", args.policies["full"]), ("rift_ada_dyn", args.policies["rift-dyn"])):
        dec = decoder(pair, policy, args)
        runs = []
        for ids in prompts:
            runs.append(profile_decode(dec, ids, args.max_new_tokens, policy.controller))
            if label == "rift_ada_dyn":
                dyn_results.append(dec.result)
        ours[label] = [r.tokens for r in runs], sum(r.seconds for r in runs)
        step = sum(r.step_seconds for r in runs)
        split[label] = {"round_seconds": step, "forward_share": sum(r.forward_seconds for r in runs) / step,
                        "refresh_share": sum(r.refresh_seconds for r in runs) / step,
                        "overhead_share": sum(r.overhead_seconds for r in runs) / step}
    return ours, split, dyn_results


def compiled_rows(pair, prompts: list, args, plain: list) -> dict:
    """The static side: our loop with the draft step and the verify on static shapes (``rift_ada.static``), eager
    (``rift_dyn_static``) and compiled (rift-dyn; the full draft cache, whose shape holds for one prompt only), and
    plain greedy ``generate`` on HF's static cache with ``torch.compile``. Each compiled path is warmed up first on
    the same shapes (compile time, ``compile_s``, is never inside tokens/s); ``warmup_graphs`` counts the graphs
    each warm-up compiled (rift-dyn: its draft step's graph and the verify's, at the first length only: a cache's
    slot axis is a size the graphs take; the full draft cache then runs the same graphs), ``recompiles`` those
    compiled during the timed runs."""
    from rift_ada.evaluate import decode

    runs = {"rift_dyn": ("rift-dyn", "compiled"), "full": ("full", "compiled"),
            "rift_dyn_static": ("rift-dyn", "static")}
    compile_s, warmup_graphs, tokens, seconds, results, timed_graphs = {}, {}, {}, {}, {}, 0
    for label, (policy_name, step) in runs.items():
        policy = args.policies[policy_name]
        dec = decoder(pair, policy, args, step)  # one decoder: its steps' buffers, hence its CUDA graphs, are kept

        def run(ids, dec=dec, policy=policy):
            return decode(dec, ids, args.max_new_tokens, policy.controller)

        # Warm-up on the first prompt and the generation's max_new_tokens: the target's static cache (and a full
        # draft cache) is sized for them.
        if step == "compiled":  # static is eager: nothing to compile
            compile_s[label], warmup_graphs[label] = warm_up(lambda: run(prompts[0]))
        before = compiled_graphs()
        results[label] = [run(ids) for ids in prompts]
        timed_graphs += compiled_graphs() - before
        tokens[label] = [r.tokens for r in results[label]]
        seconds[label] = sum(r.decode_seconds for r in results[label])
    greedy = compiled_greedy(pair.target, pair.tokenizer.eos_token_id)
    compile_s["greedy"], warmup_graphs["greedy"] = warm_up(lambda: greedy(prompts[0], args.max_new_tokens))
    before = compiled_graphs()
    tokens["greedy"], t_all = timed(lambda: [greedy(ids, args.max_new_tokens) for ids in prompts])
    _, t_one = timed(lambda: [greedy(ids, 1) for ids in prompts])
    timed_graphs += compiled_graphs() - before
    after_first = sum(len(t) for t in plain) - len(prompts)
    name = lambda k: k if k.endswith("_static") else f"{k}_compiled"  # noqa: E731
    return {"tokens_per_s": {"greedy_compiled": after_first / max(t_all - t_one, 1e-9),
                             **{name(k): after_first / seconds[k] for k in runs}},
            "draft_ms_per_step": {"compiled": draft_ms_per_step(results["rift_dyn"]),
                                  "static": draft_ms_per_step(results["rift_dyn_static"])},
            "verify_ms_per_round": {k: verify_ms_per_round(results[k]) for k in ("rift_dyn", "rift_dyn_static")},
            "same_output": {name(k): tokens[k] == plain for k in tokens},
            "compile_s": compile_s, "warmup_graphs": warmup_graphs, "recompiles": timed_graphs}


if __name__ == "__main__":
    sys.exit(main())
