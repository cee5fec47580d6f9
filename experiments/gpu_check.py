"""GPU check on real-size shapes, with no download: randomly initialised Qwen3-8B-shaped target and Qwen3-4B-shaped
draft in bf16, prompts of 8K/16K/32K tokens, one prepared run of a few minutes on an H200.

    python experiments/gpu_check.py --output gpu_check.json        # on a CUDA machine (the shapes above)
    python experiments/gpu_check.py --tiny                         # the same code at toy sizes, on CPU (the test)

Per input length it reports
- the draft's time per step with the full cache and with an 8K budget (rift-stat: the prefill's selection stays;
  rift-dyn: rescored every ``--period`` tokens from the backing store), and the bytes the draft's attention reads per
  step (its active KV) beside its weights, as milliseconds at the device's peak bandwidth (``--peak-tb-s``, H200:
  4.8 TB/s): how close a step is to the memory bound;
- each round's time split: draft / verify / refresh / rollback, and the framework's overhead (the rest of
  ``step()``: sampling, bookkeeping, the drift signal), timed by ``rift_ada.profiling.profile_decode``, which also
  gives the share of round time inside model forwards (``forward_share``) and outside forwards and rescoring
  (``overhead_share``);
- the models alone: a one-token draft forward and a (k+1)-token verify forward on transformers' own cache, so the
  draft step's time can be split into the model and what our loop adds around it;
- end-to-end tokens/s (prefill included) of our loop (full and 8K-budget draft caches) against HF assisted generation
  (same pair; fixed ``k`` draft tokens, and HF's defaults: 20 tokens with a confidence stop) and plain greedy
  decoding, with how many leading tokens each run shares with plain greedy.

Random weights give nearly flat logits, so acceptance is near zero (every round drafts k tokens and keeps about
one): the figures are costs, not speed-ups. For the same reason bf16 rounding differences between kernels (a
12-token verify forward against HF's one-token steps) can flip an argmax; the token agreement is reported, not
asserted. Losslessness is checked where it is meaningful, on the trained testbed pair on the same device
(``greedy_check`` in float32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from rift_ada.bench import (add_benchmark_options, bare_forward_ms, compiled_graphs, draft_ms_per_step, prepare_run,
                            shared_prefix, time_hf_assisted, timed, verify_ms_per_round, warm_up)
from rift_ada.cli import ArgumentParser, add_runtime_options, fail, write_output

# Shapes from the Qwen3 model cards (config.json of Qwen/Qwen3-8B and Qwen/Qwen3-4B).
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
# Tiny shapes use a large init: peaked logits leave no near-ties, so greedy outputs can be compared exactly.
TINY_TARGET = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False,
                   initializer_range=0.2)
TINY_DRAFT = dict(TINY_TARGET, hidden_size=64, num_hidden_layers=2, tie_word_embeddings=True)


def random_model(shape: dict, max_len: int, device: str, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, max_position_embeddings=max_len, rope_theta=1_000_000, rms_norm_eps=1e-6,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def n_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes and lengths: tests this script on CPU")
    add_benchmark_options(p, lengths=None, lengths_help="input lengths (default 8192 16384 32768)", budget=None,
                          budget_help="draft budget in tokens (default 8192; --tiny 128)", max_new_tokens=64,
                          compile_help="also rift-dyn with the draft step and the verify compiled on static shapes "
                                       "(rift_ada.static; CUDA graphs on GPU), after a warm-up that compiles them "
                                       "(compile_s, never in the timed run)")
    p.add_argument("--peak-tb-s", type=float, default=4.8, help="device memory bandwidth, TB/s (H200: 4.8)")
    p.add_argument("--skip-testbed", action="store_true", help="skip the lossless check on the testbed pair")
    add_runtime_options(p)
    args = p.parse_args(argv)
    args.lengths = args.lengths or ([256, 512] if args.tiny else [8192, 16384, 32768])
    args.budget = args.budget or (128 if args.tiny else 8192)
    if (min(args.lengths) < 1 or args.budget < 1 or args.period < 1 or args.draft_length < 1
            or args.max_new_tokens < 2):
        p.error("lengths, budget, period and draft length must be >= 1, max-new-tokens >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        policies = prepare_run(args)
    except ValueError as e:
        return fail(e)
    device = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if device == "cpu" else torch.bfloat16
    max_len = max(args.lengths) + args.max_new_tokens + 16
    t0 = time.perf_counter()
    target = random_model(TINY_TARGET if args.tiny else QWEN3_8B, max_len, device, dtype, seed=1)
    draft = random_model(TINY_DRAFT if args.tiny else QWEN3_4B, max_len, device, dtype, seed=2)
    report = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
        "target": "tiny" if args.tiny else "Qwen3-8B shape", "draft": "tiny" if args.tiny else "Qwen3-4B shape",
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "budget": args.budget, "period": args.period, "draft_length": args.draft_length,
        "max_new_tokens": args.max_new_tokens, "peak_tb_s": args.peak_tb_s, "init_s": time.perf_counter() - t0,
        "lengths": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "lengths"}), file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(0)
    for length in args.lengths:
        prompt = torch.randint(0, target.config.vocab_size, (length,), generator=gen).tolist()
        report["lengths"].append(bench_length(target, draft, prompt, policies, args))
        print(json.dumps(report["lengths"][-1]), file=sys.stderr, flush=True)
        write_output(args.output, report)  # each length as it finishes: a run cut short keeps what it measured
    del target, draft
    if not args.skip_testbed:
        report["testbed_lossless"] = testbed_lossless(device, args.draft_length)
    report["seconds"] = time.perf_counter() - t0
    print(json.dumps(report, indent=1))
    print(table(report))
    write_output(args.output, report)
    return 0


def bench_length(target, draft, prompt: list[int], policies: dict, args) -> dict:
    """One input length's row: plain greedy, our loop with each draft cache (and rift-dyn compiled), HF assisted
    generation, and the models' bare forwards."""
    from rift_ada.models import greedy_reference
    from rift_ada.speculative import SpeculativeDecoder

    peak, dw = args.peak_tb_s * 1e12, n_bytes(draft)
    row = {"input_tokens": len(prompt)}
    plain, t_plain = timed(lambda: greedy_reference(target, prompt, args.max_new_tokens), args.device)
    row["target_greedy_tokens_per_s"] = args.max_new_tokens / t_plain
    for name, policy in policies.items():
        dec = SpeculativeDecoder(target, draft, policy.layout, args.draft_length)
        tokens, row[name] = run_policy(dec, prompt, args.max_new_tokens, policy.controller, peak, dw)
        row[name]["shared_prefix_with_greedy"] = shared_prefix(tokens, plain)
        del dec
    if args.compile:
        row.update(compiled_rift_dyn(target, draft, prompt, plain, policies["rift-dyn"], args, peak, dw))
    hf = time_hf_assisted(target, draft, [prompt], args.max_new_tokens, args.draft_length, device=args.device)
    for name, ([tokens], seconds) in hf.items():
        row[name] = {"tokens_per_s": len(tokens) / seconds, "shared_prefix_with_greedy": shared_prefix(tokens, plain)}
    # The models alone, on HF's own cache: what a draft step and a verify pass cost without our loop around them.
    row["bare_draft_forward_ms"] = bare_forward_ms(draft, prompt, 1)
    row["bare_verify_forward_ms"] = bare_forward_ms(target, prompt, args.draft_length + 1)
    if args.device.startswith("cuda"):
        row["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return row


def run_policy(dec, prompt, max_new, controller, peak_bytes_s, draft_weight_bytes):
    """Decode once with ``rift_ada.profiling.profile_decode``: it times every step() from outside (so the phases the
    decoder records can be subtracted: the rest is the framework's overhead) and the models' forwards inside."""
    from rift_ada.profiling import profile_decode

    prof = profile_decode(dec, prompt, max_new, controller)
    prefill, total = prof.seconds - prof.step_seconds, prof.step_seconds
    rounds = dec.result.rounds
    phases = {p: sum(getattr(r, f"{p}_seconds") for r in rounds) for p in ("draft", "verify", "refresh", "rollback")}
    kv = max(r.active_kv_bytes for r in rounds)
    return prof.tokens, {
        "prefill_s": prefill,
        "rounds": len(rounds),
        "acceptance_length": len(prof.tokens[1:]) / max(len(rounds), 1),
        "refreshes": dec.result.refreshes,
        "draft_ms_per_step": draft_ms_per_step([dec.result]),
        "draft_active_kv_bytes": kv,
        "draft_attention_read_ms_at_peak": 1000 * kv / peak_bytes_s,
        "draft_weights_read_ms_at_peak": 1000 * draft_weight_bytes / peak_bytes_s,
        "round_ms": 1000 * total / max(len(rounds), 1),
        "verify_ms": verify_ms_per_round([dec.result]),
        "round_split": {**{p: s / total for p, s in phases.items()},
                        "overhead": max(total - sum(phases.values()), 0.0) / total},
        # The same rounds split by work (profile_decode): model forwards, rescoring, everything else.
        "forward_share": prof.forward_seconds / total,
        "overhead_share": prof.overhead_share,
        "decode_tokens_per_s": (len(prof.tokens) - 1) / total,  # after the first token (prefill excluded)
        "tokens_per_s": len(prof.tokens) / prof.seconds,  # end to end, as HF generate is timed
    }


def compiled_rift_dyn(target, draft, prompt, plain, policy, args, peak, dw) -> dict:
    """rift-dyn with the draft step and the verify compiled (``rift_ada.static``): a warm-up on the same prompt
    compiles them (``compile_s``; ``warmup_graphs``: the draft step's graph at the first length only, the verify's at
    each, as the target's static cache holds the prompt), then the timed run (``recompiles``: graphs compiled during
    it)."""
    from rift_ada.speculative import SpeculativeDecoder

    dec = SpeculativeDecoder(target, draft, policy.layout, args.draft_length, draft_step="compiled",
                             verify_step="compiled")
    compile_s, warm = warm_up(lambda: run_policy(dec, prompt, args.max_new_tokens, policy.controller, peak, dw),
                              args.device)
    before = compiled_graphs()
    tokens, row = run_policy(dec, prompt, args.max_new_tokens, policy.controller, peak, dw)
    row["shared_prefix_with_greedy"] = shared_prefix(tokens, plain)
    return {"rift-dyn-compiled": row, "compile_s": compile_s, "warmup_graphs": warm,
            "recompiles": compiled_graphs() - before}


def testbed_lossless(device: str, k: int) -> dict:
    """Greedy speculative decoding on the trained testbed pair, on this device in float32, against the target's own
    greedy output: every policy must reproduce it token for token."""
    from rift_ada.data import build_tasks, encode
    from rift_ada.evaluate import evaluate
    from rift_ada.models import load_pair
    from rift_ada.policies import make_policy
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    pair = load_pair("testbed", "testbed-draft", device=device, dtype="float32")
    prompts = [encode(pair.tokenizer, t.prompt) for t in build_tasks(pair.tokenizer, "low", n=2, input_tokens=2048)]
    out = {}
    for name, kw in (("full", {}), ("rift-stat", {"budget": 256}), ("rift-dyn", {"budget": 256, "period": 32})):
        pol = make_policy(name, **kw)
        dec = SpeculativeDecoder.for_pair(pair, pol.layout, Decoding(k))
        ev = evaluate(dec, prompts, pol.controller, 128, greedy_check=True)
        out[name] = {"acceptance_length": ev.summary["acceptance_length"],
                     "target_greedy_match": ev.summary["target_greedy_match"]}
    return out


def table(report: dict) -> str:
    """The README's table: one row per input length."""
    lines = ["| input | draft ms/step: full / 8K rift / model alone | draft KV at peak bandwidth (ms): full / rift | "
             "draft weights at peak (ms) | verify ms: ours / model alone | rift-dyn round: draft / verify / refresh / "
             "rollback / other | tok/s: ours full / rift-dyn / HF k=11 / HF default / greedy |",
             "|---|---|---|---|---|---|---|"]
    for r in report["lengths"]:
        f, s, d = r["full"], r["rift-stat"], r["rift-dyn"]
        split = " / ".join(f"{100 * d['round_split'][k]:.0f}%" for k in ("draft", "verify", "refresh", "rollback",
                                                                         "overhead"))
        lines.append(
            f"| {r['input_tokens']} | {f['draft_ms_per_step']:.1f} / {s['draft_ms_per_step']:.1f} / "
            f"{r['bare_draft_forward_ms']:.1f} | {f['draft_attention_read_ms_at_peak']:.2f} / "
            f"{s['draft_attention_read_ms_at_peak']:.2f} | {f['draft_weights_read_ms_at_peak']:.2f} | "
            f"{f['verify_ms']:.1f} / {r['bare_verify_forward_ms']:.1f} | {split} | {f['tokens_per_s']:.2f} / "
            f"{d['tokens_per_s']:.2f} / {r['hf_assisted']['tokens_per_s']:.2f} / "
            f"{r['hf_assisted_default']['tokens_per_s']:.2f} / {r['target_greedy_tokens_per_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
