"""What the testbed pair costs at the paper's scale: prefill, one decode step, and a long plain greedy decode.

    python experiments/testbed_costs.py                     # 32K prompt (pip, low), budget 8K; 24 min on 2 cores
    python experiments/testbed_costs.py --input-tokens 4096 --greedy-tokens 256 --steps 16    # a quick look
    python experiments/testbed_costs.py --round-costs --output costs-32k.json   # the joint cost model; 12 min

On one ``low`` prompt of ``--input-tokens`` (a code base the pair never saw, ``--source-dir``), it measures:
- ``prefill_s``: the target's and the draft's prefill (transformers' dynamic cache, the logits of the last position);
- ``step_ms``: one decode step after that prompt, the target's and the draft's with a full cache (the first
  ``--steps`` plain greedy steps on ``rift_ada.static``'s static cache, averaged; the prefill is the one above);
- ``rift``: speculative decoding of ``--steps`` tokens with the draft's cache held to ``--budget`` tokens (rift-stat:
  half selected prompt, half window), external draft, k = ``--draft-length``: the draft's milliseconds per draft step
  and the target's per verify of k + 1 tokens, as the decoder's per-round records time them;
- ``greedy``: a plain greedy decode of ``--greedy-tokens`` tokens by the target after the prompt (0: skip; the
  same steps continued), whose tokens per second every speculative figure at this length is compared with, and its
  last step's milliseconds (the context then ``--greedy-tokens`` longer).

With ``--round-costs``, instead: the joint controller's round costs at this length (``rift_ada.joint``'s
``measure_round_costs``: static steps, a RIFT cache of ``--budget`` tokens refreshing on demand, every k of
``--draft-lengths``) and the draft's full-cache step, under ``costs.testbed``: the file ``gpu_check.py --model-from``
reads, so acceptance tables (a paper-regime run's 32K tables) are priced by what this machine measured.

Prints one JSON object (and writes it to ``--output``). Timings are wall-clock on whatever the machine is doing:
run it alone (docs/measuring.md).
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main(argv=None) -> int:
    from rift_ada.cli import (ArgumentParser, add_model_options, add_runtime_options, apply_runtime, fail,
                              require_positive, write_output)
    from rift_ada.joint.control import DRAFT_LENGTHS


    p = ArgumentParser(description=__doc__)
    add_model_options(p, drafter="testbed")
    p.add_argument("--input-tokens", type=int, default=32768, help="prompt length (default %(default)s)")
    p.add_argument("--source-dir", default="pip", help="code base the prompt is built from (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which prompt (task seed)")
    p.add_argument("--budget", type=int, default=8192, help="the draft cache's token budget (default %(default)s)")
    p.add_argument("--draft-length", type=int, default=11, help="k (default %(default)s)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per row (default %(default)s)")
    p.add_argument("--greedy-tokens", type=int, default=4096,
                   help="tokens of the plain greedy decode after the prompt (0: skip; default %(default)s)")
    p.add_argument("--round-costs", action="store_true",
                   help="measure the joint controller's round costs (and the full-cache draft step) instead")
    p.add_argument("--draft-lengths", type=int, nargs="+", default=list(DRAFT_LENGTHS),
                   help="with --round-costs: the draft lengths priced (0: a plain target step)")
    p.add_argument("--output", default=None, help="write the JSON here instead of stdout")
    add_runtime_options(p)
    args = p.parse_args(argv)
    require_positive(p, args, ["input_tokens", "budget", "draft_length", "steps"])
    if args.greedy_tokens < 0:
        p.error("--greedy-tokens must be >= 0")
    if args.round_costs and not (0 < max(args.draft_lengths) <= args.draft_length and min(args.draft_lengths) >= 0):
        p.error(f"--draft-lengths must lie in 0..--draft-length ({args.draft_length}), one >= 1")
    try:
        apply_runtime(args)
        result = (round_costs if args.round_costs else measure)(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    write_output(args.output, result)
    print(json.dumps(result))
    return 0


@torch.inference_mode()
def prefill_then_steps(model, ids: list[int], steps: int) -> tuple[float, list[float]]:
    """(prefill seconds, each greedy step's seconds): the prompt through transformers' dynamic cache, then ``steps``
    plain greedy steps on ``rift_ada.static``'s static cache (as ``rift_ada.studies.decode_bench.plain_decode``), one prefill for
    both."""
    from transformers import DynamicCache

    from rift_ada.static import StaticKV, StaticVerify

    cache = DynamicCache(config=model.config)
    t = time.perf_counter()
    token = int(model(torch.tensor([ids], device=model.device), cache=cache, logits_to_keep=1).logits[0, -1].argmax())
    prefill_s = time.perf_counter() - t
    cache, step, times = StaticKV(cache, len(ids) + steps + 1), StaticVerify(model, 1), []
    for _ in range(steps):
        t = time.perf_counter()
        token = int(step(cache, [token])[-1].argmax())
        times.append(time.perf_counter() - t)
    return prefill_s, times


def pair_and_prompt(args) -> tuple:
    """The pair and the ``low`` prompt every measurement here runs on (``--input-tokens`` of ``--source-dir``)."""
    from rift_ada.data.tasks import build_tasks, encode
    from rift_ada.models import load_pair

    pair = load_pair(args.target, args.drafter, dtype=args.dtype, device=args.device)
    task = build_tasks(pair.tokenizer, "low", n=1, input_tokens=args.input_tokens, seed=args.seed,
                       source_dir=args.source_dir)[0]
    return pair, encode(pair.tokenizer, task.prompt)


@torch.inference_mode()
def measure(args) -> dict:
    from tqdm.auto import tqdm

    from rift_ada.studies.decode_bench import draft_ms_per_step, verify_ms_per_round
    from rift_ada.evaluate import decode
    from rift_ada.layout import CacheLayout
    from rift_ada.metrics import acceptance_length
    from rift_ada.speculative import SpeculativeDecoder

    pair, ids = pair_and_prompt(args)
    out = {"prompt_tokens": len(ids), "source_dir": args.source_dir, "threads": torch.get_num_threads(),
           "budget": args.budget, "draft_length": args.draft_length, "steps": args.steps}
    bar = tqdm(total=3, desc="testbed costs", file=sys.stderr)
    # The target's first --steps greedy steps are its step cost; all --greedy-tokens of them, the long greedy decode.
    for role, model, steps in (("target", pair.target, max(args.steps, args.greedy_tokens - 1)),
                               ("draft", pair.draft, args.steps)):
        prefill_s, times = prefill_then_steps(model, ids, steps)
        out[f"{role}_prefill_s"] = round(prefill_s, 2)
        out[f"{role}_step_ms"] = round(1e3 * sum(times[:args.steps]) / args.steps, 2)
        if role == "target" and args.greedy_tokens:
            n = args.greedy_tokens - 1  # the first token comes from the prefill
            out["greedy"] = {"tokens": args.greedy_tokens, "seconds": round(sum(times[:n]), 1),
                             "tokens_per_s": round(n / sum(times[:n]), 2) if n else None,
                             "last_step_ms": round(1e3 * times[n - 1], 2) if n else None}
        bar.update(1)
    dec = SpeculativeDecoder(pair.target, pair.draft, CacheLayout("rift", budget=args.budget),
                             draft_length=args.draft_length)
    res = decode(dec, ids, args.steps, None)
    out["rift"] = {"draft_ms_per_step": round(draft_ms_per_step([res]), 2),
                   "verify_ms": round(verify_ms_per_round([res]), 2), "rounds": len(res.rounds),
                   "acceptance_length": round(acceptance_length(res.rounds), 2)}
    bar.update(1)
    bar.close()
    return out


@torch.inference_mode()
def round_costs(args) -> dict:
    """The round costs at this length and the full-cache draft step, as ``costs.testbed`` (gpu_check's format)."""
    from rift_ada.joint.costs import measure_round_costs
    from rift_ada.layout import CacheLayout
    from rift_ada.speculative import SpeculativeDecoder

    pair, ids = pair_and_prompt(args)
    dec = SpeculativeDecoder(pair.target, pair.draft, CacheLayout("rift", budget=args.budget),
                             draft_length=args.draft_length, draft_step="static", verify_step="static")
    costs = measure_round_costs(dec, {len(ids): ids}, args.draft_lengths, progress=True)
    _, full = prefill_then_steps(pair.draft, ids, args.steps)
    return {"prompt_tokens": len(ids), "source_dir": args.source_dir, "threads": torch.get_num_threads(),
            "budget": args.budget, "draft_length": args.draft_length,
            "costs": {"testbed": {"rift": costs.to_dict(), "full_draft_s": [sum(full) / len(full)]}}}


if __name__ == "__main__":
    sys.exit(main())
