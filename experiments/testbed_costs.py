"""What the testbed pair costs at the paper's scale: prefill, one decode step, and a long plain greedy decode.

    python experiments/testbed_costs.py                     # 32K prompt (pip, low), budget 8K; ~45 min on 2 cores
    python experiments/testbed_costs.py --input-tokens 4096 --greedy-tokens 256 --steps 16    # a quick look

On one ``low`` prompt of ``--input-tokens`` (a code base the pair never saw, ``--source-dir``), it measures:
- ``prefill_s``: the target's and the draft's prefill (transformers' dynamic cache, the logits of the last position);
- ``step_ms``: one decode step after that prompt, the target's and the draft's with a full cache (``--steps`` plain
  greedy steps on ``rift_ada.static``'s static cache, averaged);
- ``rift``: speculative decoding of ``--steps`` tokens with the draft's cache held to ``--budget`` tokens (rift-stat:
  half selected prompt, half window), external draft, k = ``--draft-length``: the draft's milliseconds per draft step
  and the target's per verify of k + 1 tokens, as the decoder's per-round records time them;
- ``greedy``: a plain greedy decode of ``--greedy-tokens`` tokens by the target after the prompt (0: skip), whose
  tokens per second every speculative figure at this length is compared with.

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
    p.add_argument("--output", default=None, help="write the JSON here instead of stdout")
    add_runtime_options(p)
    args = p.parse_args(argv)
    require_positive(p, args, ["input_tokens", "budget", "draft_length", "steps"])
    if args.greedy_tokens < 0:
        p.error("--greedy-tokens must be >= 0")
    try:
        apply_runtime(args)
        result = measure(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    write_output(args.output, result)
    print(json.dumps(result))
    return 0


@torch.inference_mode()
def measure(args) -> dict:
    from transformers import DynamicCache
    from tqdm.auto import tqdm

    from rift_ada.bench import draft_ms_per_step, plain_decode, verify_ms_per_round
    from rift_ada.data.tasks import build_tasks, encode
    from rift_ada.evaluate import decode
    from rift_ada.layout import CacheLayout
    from rift_ada.metrics import acceptance_length
    from rift_ada.models import load_pair
    from rift_ada.speculative import SpeculativeDecoder

    pair = load_pair(args.target, args.drafter, dtype=args.dtype, device=args.device)
    task = build_tasks(pair.tokenizer, "low", n=1, input_tokens=args.input_tokens, seed=args.seed,
                       source_dir=args.source_dir)[0]
    ids = encode(pair.tokenizer, task.prompt)
    out = {"prompt_tokens": len(ids), "source_dir": args.source_dir, "threads": torch.get_num_threads(),
           "budget": args.budget, "draft_length": args.draft_length, "steps": args.steps}
    bar = tqdm(total=5 if args.greedy_tokens else 4, desc="testbed costs", file=sys.stderr)
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        t = time.perf_counter()
        model(torch.tensor([ids], device=model.device), cache=DynamicCache(config=model.config), logits_to_keep=1)
        out[f"{role}_prefill_s"] = round(time.perf_counter() - t, 2)
        bar.update(1)
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        _, seconds = plain_decode(model, ids, args.steps + 1, None)
        out[f"{role}_step_ms"] = round(1e3 * seconds / args.steps, 2)
        bar.update(1)
    dec = SpeculativeDecoder(pair.target, pair.draft, CacheLayout("rift", budget=args.budget),
                             draft_length=args.draft_length)
    res = decode(dec, ids, args.steps, None)
    out["rift"] = {"draft_ms_per_step": round(draft_ms_per_step([res]), 2),
                   "verify_ms": round(verify_ms_per_round([res]), 2), "rounds": len(res.rounds),
                   "acceptance_length": round(acceptance_length(res.rounds), 2)}
    bar.update(1)
    if args.greedy_tokens:
        tokens, seconds = plain_decode(pair.target, ids, args.greedy_tokens, None)
        out["greedy"] = {"tokens": len(tokens), "seconds": round(seconds, 1),
                         "tokens_per_s": round((len(tokens) - 1) / seconds, 2)}
        bar.update(1)
    bar.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
