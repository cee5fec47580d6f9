"""GPU check at real shapes, no download: each compiled step's time beside its bandwidth bound, the round costs that
price acceptance tables, and the shipped testbed pair's compiled decoding; one prepared run of ~6 minutes on an H200.

    python experiments/gpu_check.py --output gpu.json                     # a CUDA machine: the shapes below
    python experiments/gpu_check.py --tiny                                # the same code at toy sizes on CPU (tested)
    python experiments/gpu_check.py --model-from gpu.json --tables DIR    # modelled tokens/s from its costs (no device)

Randomly initialised Qwen3-8B-shaped target and Qwen3-4B- and Qwen3-0.6B-shaped drafts (``--drafts``), bf16 on
CUDA. Sections (``--sections``), in this order; the JSON is written after each, so a run cut short keeps what it
measured:

- ``steps``: per input length (``--lengths``, default 32K and 128K), each draft's compiled step with the RIFT budget
  (``--budget``, 8K) and, for the drafts in ``--full``, with the full cache, and the target's compiled verify of k + 1
  tokens and its compiled plain step; a refresh of each RIFT cache. Each time sits beside its bound: the bytes the
  step must read (weights, less an untied input embedding, of which it reads one row; plus the active KV) at the
  device's peak bandwidth (``--peak-tb-s``, H200 4.8), and their ratio. Prompts are prefilled in chunks. From these,
  one ``RoundCosts`` per draft (``rift_ada.joint``: verify at blocks 1 (the plain step) and 2..k + 1 (the verify is
  padded to its block), draft step and refresh by length) and the full-cache step's time by length.
- ``testbed``: the shipped pair on a ``--testbed-length`` (4K) ``low`` prompt in float32: rift-dyn with both steps
  compiled against compiled greedy decoding (HF's ``generate`` on its static cache with ``torch.compile``, and our
  compiled plain step with the tokens on the device), decode tokens/s, every output equal to HF's greedy output.
- ``decode``: one compiled rift-dyn generation with the first draft at the first length (device rounds; random
  weights accept nothing, so it checks the round's cost, not a speed-up): decode tokens/s, host reads per round,
  ms per draft step inside the loop.
- ``ties``: at ``--tie-length`` (7K) in bf16, where HF's greedy output and ours (static greedy, rift-dyn) part: the
  float32 target's margin between the two tokens there (a near-tie, or a bug).

Any CUDA graph inductor skips fails the run (``torch._inductor.config.triton.cudagraph_or_error``; and inductor's
count of skips is checked after each section); HF's compiled ``generate``, a baseline, is only reported.
``--model-from`` reads such a JSON's costs and replays acceptance tables (``rift_ada.replay``, e.g. a paper-regime
run's 32K tables) under them: modelled decode tokens/s of greedy decoding, full-cache drafting, RIFT-dyn and a joint
controller (``--controller``), priced at each measured length (``rift_ada.joint.replay.modelled_paths``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from rift_ada.cli import ArgumentParser, add_runtime_options, fail, write_output
from rift_ada.studies.gpu_sections import (DRAFTS, QWEN3_8B, REPS, SECTIONS, TINY_DRAFTS, TINY_TARGET, GraphGuard,
                                           decode_section, failed, model_section, random_model, steps_section,
                                           testbed_section, ties_section)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes and lengths: tests this script on CPU")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="input lengths (default 32768 131072)")
    p.add_argument("--drafts", default="4b,0.6b", help="draft shapes to time: 4b, 0.6b")
    p.add_argument("--full", default="0.6b", help="drafts whose full-cache step is timed too ('' for none)")
    p.add_argument("--budget", type=int, default=None, help="draft budget in tokens (default 8192; --tiny 64)")
    p.add_argument("--period", type=int, default=32, help="rift-dyn: generated tokens between refreshes")
    p.add_argument("--draft-length", type=int, default=11, help="draft tokens per round (k)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens of the decode section's generation")
    p.add_argument("--steps", choices=("compiled", "static"), default="compiled",
                   help="compiled (CUDA graphs on GPU) or the same static steps eager")
    p.add_argument("--prefill", choices=("random", "model"), default="random",
                   help="steps section: the caches of random keys and values (the default: a step's time does not "
                        "depend on them) or prefilled through the models in chunks")
    p.add_argument("--attention", choices=("auto", "matmul", "sdpa"), default="auto",
                   help="the steps' attention (rift_ada.static.ATTENTION; auto: matmul on CUDA, SDPA elsewhere)")
    p.add_argument("--peak-tb-s", type=float, default=4.8, help="device memory bandwidth, TB/s (H200: 4.8)")
    p.add_argument("--testbed-length", type=int, default=None, help="testbed section's input (default 4096)")
    p.add_argument("--testbed-new-tokens", type=int, default=256,
                   help="tokens the testbed section generates (the ties section: at most 128 of them)")
    p.add_argument("--tie-length", type=int, default=None, help="ties section's input (default 7168)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    m = p.add_argument_group("modelled tokens/s (no device)")
    m.add_argument("--model-from", default=None, help="a JSON this script wrote: model from its costs instead")
    m.add_argument("--tables", default=None,
                   help="a folder of replay tables to price (its main tables, <name>.safetensors; those derived "
                        "from them for other caches are not read)")
    m.add_argument("--controller", default=None, help="a joint controller file to price beside the fixed paths")
    add_runtime_options(p)
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if bad := [s for s in args.sections if s not in SECTIONS]:
        p.error(f"--sections: unknown {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    args.drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    args.full = [d.strip() for d in args.full.split(",") if d.strip()]
    if bad := [d for d in args.drafts + args.full if d not in DRAFTS]:
        p.error(f"--drafts / --full: unknown {', '.join(bad)}; choose from {', '.join(DRAFTS)}")
    if not args.drafts:
        p.error("--drafts: name at least one draft")
    args.lengths = args.lengths or ([160, 320] if args.tiny else [32768, 131072])
    args.budget = args.budget or (64 if args.tiny else 8192)
    args.testbed_length = args.testbed_length or (512 if args.tiny else 4096)
    args.tie_length = args.tie_length or (600 if args.tiny else 7168)
    if (min(args.lengths) < 2 or args.budget < 2 or args.period < 1 or not 1 <= args.draft_length <= 63
            or args.max_new_tokens < 2 or args.testbed_length < 64 or args.tie_length < 64
            or args.testbed_new_tokens < 2 or args.peak_tb_s <= 0):
        p.error("lengths and budget must be >= 2, period >= 1, draft length in 1..63, max-new-tokens >= 2, "
                "testbed and tie lengths >= 64, peak bandwidth > 0")
    if (args.model_from is None) != (args.tables is None):
        p.error("--model-from and --tables go together")
    return args


# --- the run -----------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from rift_ada.cli import apply_runtime, check_output

        apply_runtime(args)
        check_output(args.output)
        if args.model_from:
            report = model_section(args)
            print(json.dumps(report, indent=1))
            write_output(args.output, report)
            return 0
    except (ValueError, FileNotFoundError, OSError) as e:
        return fail(e)
    import rift_ada.static

    rift_ada.static.ATTENTION = None if args.attention == "auto" else args.attention
    device = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if device == "cpu" else torch.bfloat16
    guard = GraphGuard(device)
    t0 = time.perf_counter()
    report = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "tiny": args.tiny,
              "steps_kind": args.steps, "attention": rift_ada.static.attention_for(device), "budget": args.budget,
              "draft_length": args.draft_length, "peak_tb_s": args.peak_tb_s, "sections": args.sections}

    def save():
        report["seconds"] = time.perf_counter() - t0
        write_output(args.output, report)  # each part as it finishes: a run cut short keeps what it measured

    needs_models = {"steps", "decode"} & set(args.sections)
    if needs_models:
        max_len = max(args.lengths) + 4 * (REPS + 4) + args.max_new_tokens + 2 * args.draft_length + 16
        target = random_model(TINY_TARGET if args.tiny else QWEN3_8B, max_len, device, dtype, seed=1)
        shapes = TINY_DRAFTS if args.tiny else DRAFTS
        drafts = {name: random_model(shapes[name], max_len, device, dtype, seed=2 + i)
                  for i, name in enumerate(args.drafts)}
        from rift_ada.attention import use_rift_attention

        for model in drafts.values():
            use_rift_attention(model)
        report["params"] = {"target": sum(p.numel() for p in target.parameters()),
                            **{n: sum(p.numel() for p in m.parameters()) for n, m in drafts.items()}}
        report["init_s"] = time.perf_counter() - t0
        print(json.dumps(report), file=sys.stderr, flush=True)
    errors = 0
    for section in args.sections:
        t = time.perf_counter()
        try:  # a failed section is recorded and the next one runs: one device call brings back all it can
            if section == "steps":
                steps_section(target, drafts, args, report, save)
            elif section == "testbed":
                report["testbed"] = testbed_section(args, guard)
            elif section == "decode":
                report["decode"] = decode_section(target, drafts, args)
            elif section == "ties":
                report["ties"] = ties_section(args)
            guard.check(section)
        except Exception as e:
            report[f"{section}_error"] = failed(section, e, device)["error"]
            guard.allowed = guard.skips()  # counted against this section only
            errors += 1
        report.setdefault("section_s", {})[section] = time.perf_counter() - t
        print(json.dumps({section: report.get(section if section != "steps" else "costs")}), file=sys.stderr,
              flush=True)
        save()
    errors += sum("error" in str(r) for r in report.get("steps", []))
    report["cudagraph_skips"] = guard.skips()
    save()
    if report.get("steps"):
        print(table(report))
    return 1 if errors else 0


def table(report: dict) -> str:
    """One row per length and draft: ms per step, its bound and the ratio; the target's verify and plain step."""
    lines = ["| input | step | ms | bound ms | ratio |", "|---|---|---|---|---|"]
    for r in report["steps"]:
        t = r["target"]
        for name in ("verify", "plain") if "error" not in t else ():
            lines.append(f"| {r['input_tokens']} | target {name} | {t[name]['ms']:.2f} | {t[name]['bound_ms']:.2f} | "
                         f"{t[name]['ratio_to_bound']:.2f} |")
        for draft in [k for k in r if k in DRAFTS]:
            for cache, x in ((c, x) for c, x in r[draft].items() if "error" not in x):
                lines.append(f"| {r['input_tokens']} | {draft} draft, {cache} | {x['ms_per_step']:.3f} | "
                             f"{x['bound_ms']:.3f} | {x['ratio_to_bound']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
