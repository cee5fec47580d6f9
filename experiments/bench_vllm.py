"""RIFT inside vLLM: vLLM plain, vLLM's own draft model, and vLLM drafting through ``RiftProposer``.

    python experiments/bench_vllm.py                   # testbed-lm pair, held-out pip prompts, 4K and 16K, batch 1/4/8
    python experiments/bench_vllm.py --lengths 4096 --batch-sizes 4 --max-new-tokens 64 --stagger 3

Per prompt length, one engine per method (``plain``; ``draft_model``: the draft's full KV in the target's paged pool;
``rift-stat``, ``rift-dyn``, ``rift-ada``: ``rift_ada.vllm_proposer.RiftProposer``), every batch size in turn: decode
tokens/s (the engine's wall time from the first request to the last token, start-up apart), acceptance length (tokens
per verify round, read off the engine's steps: ``rift_ada.studies.vllm_engine``), the draft's KV at its largest
(RIFT: the live requests' caches, measured; ``draft_model``: the pool capacity its layers take) and refreshes per 1K
tokens; every method's greedy output is checked against plain's, token for token. ``--stagger N`` adds request i at
engine step N*i and gives the requests different lengths (continuous batching); ``--compare-decoder`` decodes the
same prompts with rift-ada's own ``SpeculativeDecoder`` (rift-dyn, the same draft and cache) for the AL comparison.

The shipped composed testbed cannot be served: vLLM's CPU attention refuses its head size (148; the draft's is 96)
with "Unsupported CPU attention configuration: head_dim=148", so the bench serves the trained pair alone
(``testbed-lm``: head size 64). Its config says 8192 positions; for 16K a copy whose config says more is served
(``long_context_folder``): memory, time and losslessness are read there, not quality.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rift_ada.studies.vllm_engine import (Request, bench_method, long_context_folder, set_engine_env)

METHODS = ("plain", "draft_model", "rift-stat", "rift-dyn", "rift-ada")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="testbed-lm", help="the served target (a folder or rift-ada model name)")
    p.add_argument("--drafter", default="testbed-lm-draft", help="the draft (RIFT and draft_model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help="prompt tokens")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["plain", "draft_model", "rift-stat", "rift-dyn"])
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--period", type=int, default=32, help="rift-dyn: generated tokens between refreshes")
    p.add_argument("--controller", default=None, help="rift-ada: an exported controller file (or periodic:N)")
    p.add_argument("-k", "--draft-length", type=int, default=11)
    p.add_argument("--task", default="low", help="the prompts' task family")
    p.add_argument("--source-dir", default="pip", help="code base the prompts are built from (held out: pip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stagger", type=int, default=0,
                   help="request i arrives at engine step STAGGER*i with max_new_tokens shortened by a varying share")
    p.add_argument("--compare-decoder", action="store_true",
                   help="also decode the prompts with rift-ada's own decoder (rift-dyn) for its AL")
    p.add_argument("--out", default="runs/bench-vllm.json")
    args = p.parse_args(argv)
    if min(args.lengths) < 2 or min(args.batch_sizes) < 1 or args.max_new_tokens < 1 or args.stagger < 0:
        p.error("--lengths must be >= 2, --batch-sizes and --max-new-tokens >= 1, --stagger >= 0")
    if "rift-ada" in args.methods and not args.controller:
        p.error("--methods rift-ada needs --controller (an exported controller file, or periodic:N)")
    if args.budget >= min(args.lengths):
        p.error(f"--budget {args.budget} keeps every prompt token at --lengths {min(args.lengths)}: nothing to compress")
    return args


def build_requests(args, length: int) -> list[Request]:
    """The largest batch's requests (a smaller batch takes the first ones): distinct held-out prompts; with
    ``--stagger``, arriving one after another and asking for different lengths."""
    from rift_ada.data import build_tasks, encode
    from rift_ada.models import load_tokenizer

    tok = load_tokenizer(args.target)
    n = max(args.batch_sizes)
    tasks = build_tasks(tok, args.task, n=n, input_tokens=length, seed=args.seed, source_dir=args.source_dir)
    reqs = []
    for i, t in enumerate(tasks):
        short = (i * 37) % 50 if args.stagger else 0  # percent taken off, varying per request
        reqs.append(Request(encode(tok, t.prompt), max(1, args.max_new_tokens * (100 - short) // 100),
                            arrive=args.stagger * i))
    return reqs


def rift_settings(method: str, args) -> dict:
    base = {"policy": method, "budget": args.budget, "max_new_tokens": args.max_new_tokens}
    if method == "rift-dyn":
        base["period"] = args.period
    if method == "rift-ada":
        base["controller"] = args.controller
    return base


def decoder_run(args, target: str, draft: str, requests: list[Request]) -> dict:
    """rift-ada's own decoder on the same prompts and settings (rift-dyn), one request at a time: its AL (tokens per
    verify round over them all) and tokens/s with the prefills counted, as the engine's are."""
    from rift_ada.evaluate import decode
    from rift_ada.models import load_pair
    from rift_ada.policies import make_policy
    from rift_ada.speculative import SpeculativeDecoder

    pair = load_pair(target, draft)
    policy = make_policy("rift-dyn", args.budget, period=args.period)
    dec = SpeculativeDecoder(pair.target, pair.draft, policy.layout, args.draft_length)
    tokens = rounds = 0
    seconds = 0.0
    for r in requests:
        res = decode(dec, r.prompt, r.max_tokens, policy.controller)
        tokens, rounds = tokens + len(res.tokens) - 1, rounds + len(res.rounds)
        seconds += res.prefill_seconds + res.decode_seconds
    return {"acceptance_length": tokens / rounds, "tokens_per_s": tokens / seconds}


def bench_length(args, length: int, stats_dir: Path) -> dict:
    requests = build_requests(args, length)  # prompts of about ``length`` tokens: the engine's context fits them all
    max_len = max(len(r.prompt) for r in requests) + args.max_new_tokens + args.draft_length + 16
    target, draft = long_context_folder(args.target, max_len), long_context_folder(args.drafter, max_len)
    batches = [requests[:b] for b in args.batch_sizes]
    row = {"input_tokens": length, "prompt_tokens": [len(r.prompt) for r in requests], "methods": {}}
    for method in args.methods:
        engine = "rift" if method.startswith("rift") else method
        rows = bench_method(target, draft, engine, rift_settings(method, args), batches, max_len, args.draft_length,
                            stats_dir)
        row["methods"][method] = rows
        print(json.dumps({"length": length, "method": method,
                          "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}), file=sys.stderr)
    plain = row["methods"].get("plain")
    for method, rows in row["methods"].items():
        for i, r in enumerate(rows):
            r["same_as_plain"] = None if plain is None else r["outputs"] == plain[i]["outputs"]
            if plain is not None:
                r["speed_vs_plain"] = r["tokens_per_s"] / plain[i]["tokens_per_s"]
    for rows in row["methods"].values():
        for r in rows:
            del r["outputs"]
    if args.compare_decoder:
        row["decoder"] = decoder_run(args, target, draft, batches[-1])
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    set_engine_env()
    report = {"target": args.target, "drafter": args.drafter, "budget": args.budget, "period": args.period,
              "k": args.draft_length, "max_new_tokens": args.max_new_tokens, "task": args.task,
              "source_dir": args.source_dir, "stagger": args.stagger, "lengths": []}
    with tempfile.TemporaryDirectory() as stats_dir:
        for length in args.lengths:
            try:
                report["lengths"].append(bench_length(args, length, Path(stats_dir)))
            except ValueError as e:  # bad settings (prompts, models, RIFT settings): one line, no trace
                print(f"bench_vllm.py: {e}", file=sys.stderr)
                return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    lossy = [(r["input_tokens"], m) for r in report["lengths"] for m, rows in r["methods"].items()
             if any(x["same_as_plain"] is False for x in rows)]
    if lossy:
        print(f"output differs from plain vLLM for: {lossy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
