"""The batched rows of ``experiments/bench_decode.py --batch-sizes`` (``rift_ada.batch``): per input length and batch
size, batched plain greedy and batched speculation with a full and a rift-dyn draft cache, all in one run, and each
batch size's round costs in the form ``experiments/gpu_check.py --model-from`` reads.

``rift_ada.studies`` holds code that serves one script each: nothing in the core imports it.
"""

from __future__ import annotations

import json
import sys
import time

RUNS = ("greedy", "full", "rift_dyn")


def add_batch_options(parser) -> None:
    g = parser.add_argument_group("batched rows (--batch-sizes)")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="run the batched rows (rift_ada.batch) at these batch sizes instead")
    g.add_argument("--batch-step", choices=("model", "static", "compiled"), default="static",
                   help="the steps every batched row runs on, greedy included (static: rift_ada.static_batch, eager; "
                        "model: the models' own forwards)")
    g.add_argument("--mixed-batch", type=int, default=8,
                   help="the size of the mixed batch (low, sort, high in turn; 0: none)")
    g.add_argument("--batch-runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="which decoders each batch runs (default: all; e.g. rift_dyn alone to measure the draft's "
                        "memory at a long context, where every run costs one target prefill per row; without greedy "
                        "there is no speed ratio, no output check and no GPU costs)")


def check_batch_options(parser, args) -> None:
    if args.batch_sizes is not None and (min(args.batch_sizes) < 1 or args.mixed_batch < 0):
        parser.error("--batch-sizes must be >= 1 and --mixed-batch >= 0")
    if args.batch_sizes is not None and args.controller:
        parser.error("--batch-sizes and --controller are separate benchmarks: run one at a time")


def batch_report(pair, args, report: dict) -> dict:
    """Every length's batched rows (:func:`bench_batches`), then each batch size's round costs (:func:`batch_costs`)."""
    report.update(batch_sizes=args.batch_sizes, period=args.period, max_new_tokens=args.max_new_tokens)
    for length in args.lengths:
        row = bench_batches(pair, length, args)
        report["lengths"].append(row)
        print(json.dumps(row), file=sys.stderr)
    report["costs"] = batch_costs(report, args)
    return report


def bench_batches(pair, length: int, args) -> dict:
    """One input length's batched rows: for each batch size a batch of distinct ``low`` prompts (and the mixed
    batch), decoded by plain greedy and by speculation with a full and a rift-dyn draft cache, all in this run, each
    checked against plain greedy's tokens. Decode only: the prefills (one per row) are outside the seconds."""
    from rift_ada.batch import batched_greedy
    from rift_ada.data import build_tasks, encode

    eos = pair.tokenizer.eos_token_id
    biggest = max(args.batch_sizes + [args.mixed_batch])

    def prompts_of(family, n, seed):
        return [encode(pair.tokenizer, t.prompt) for t in build_tasks(pair.tokenizer, family, n=n, input_tokens=length,
                                                                      seed=seed, source_dir=args.source)]

    low = prompts_of("low", biggest, args.seed)
    batches = [(f"low x{b}", low[:b]) for b in args.batch_sizes]
    if args.mixed_batch:
        per = -(-args.mixed_batch // 3)
        mixed = [p for trio in zip(*(prompts_of(f, per, args.seed + 1) for f in ("low", "sort", "high"))) for p in trio]
        batches.append((f"mixed x{args.mixed_batch}", mixed[:args.mixed_batch]))
    out = {"input_tokens": length, "step": args.batch_step, "batches": []}
    for name, prompts in batches:
        row = {"batch": name, "rows": len(prompts), "prompt_tokens": [len(p) for p in prompts]}
        plain = None
        row["tokens_per_s"], row["same_output"], row["acceptance_length"], row["split"] = {}, {}, {}, {}
        row["draft_active_kv_bytes"], row["round_costs"] = {}, {}
        if "greedy" in args.batch_runs:
            if args.batch_step == "compiled":  # compile outside the timed runs: one short generation of this batch
                batched_greedy(pair.target, prompts, 4, eos, step="compiled")
            plain, steps = batched_greedy(pair.target, prompts, args.max_new_tokens, eos, step=args.batch_step)
            row["tokens_per_s"]["greedy"] = sum(len(t) - 1 for t in plain) / sum(steps)  # 1st token: the prefill's
            row["greedy_ms_per_step"] = 1e3 * sum(steps) / len(steps)
            row["round_costs"]["greedy_step_s"] = sum(steps) / len(steps)
        for label, policy in (("full", args.policies["full"]), ("rift_dyn", args.policies["rift-dyn"])):
            if label not in args.batch_runs:
                continue
            for key, value in run_decoder(pair, policy, prompts, args, plain).items():
                row[key][label] = value
        if plain is not None:
            row["speedup_vs_greedy"] = {k: v / row["tokens_per_s"]["greedy"] for k, v in row["tokens_per_s"].items()
                                        if k != "greedy"}
        out["batches"].append(row)
        print(json.dumps(row), file=sys.stderr)
    return out


def run_decoder(pair, policy, prompts: list, args, plain) -> dict:
    """One batched speculative run of ``prompts`` under ``policy``: its decode tokens/s, output check against plain
    greedy's tokens (None without them), acceptance, the round's split, the draft's active KV and round costs."""
    from rift_ada.batch import BatchDecoder, decide_rows

    dec = BatchDecoder(pair.target, pair.draft, policy.layout, args.draft_length,
                       eos_token_id=pair.tokenizer.eos_token_id, seed=args.seed,
                       draft_step=args.batch_step, verify_step=args.batch_step)
    dec.template.phase_sync = True  # phases timed apart on a GPU too (a sync each; none on a CPU)
    if args.batch_step == "compiled":
        dec.reset(prompts, 8)
        list(dec.rounds(lambda states, c=policy.controller: decide_rows(c, states)))
    dec.reset(prompts, args.max_new_tokens)
    rounds, wall = [], 0.0
    while not dec.done:
        refresh = decide_rows(policy.controller, dec.states)
        t0 = time.perf_counter()
        rounds.append(dec.step(refresh))
        wall += time.perf_counter() - t0
    seconds = {phase: sum(r.seconds[f"{phase}_seconds"] for r in rounds)
               for phase in ("refresh", "draft", "verify", "rollback")}
    seconds["host"] = wall - sum(seconds.values())  # the rest: closing each row's round, the records
    new = sum(len(r.tokens) - 1 for r in dec.results)  # the first token of each row comes with its prefill
    return {"tokens_per_s": new / wall,
            "same_output": None if plain is None else [r.tokens for r in dec.results] == plain,
            "acceptance_length": new / sum(len(r.rounds) for r in dec.results),
            "split": {**{p: s / wall for p, s in seconds.items()}, "rounds": len(rounds),
                      "round_ms": 1e3 * wall / len(rounds)},
            # The batch's draft KV at its largest round: the sum over the rows that took part.
            "draft_active_kv_bytes": max(sum(rec.active_kv_bytes for rec in r.records.values()) for r in rounds),
            "round_costs": round_costs(rounds, args.draft_length)}


def round_costs(rounds, k: int) -> dict:
    """A batch's measured round costs (seconds, for all its rows at once): the verify of a full round (k + 1 tokens a
    row, with both caches' rollback), one draft step, and one row's refresh, as medians over the rounds that drafted
    k for every row (the last rounds, with rows ending, draft fewer)."""
    from statistics import median

    whole = [r for r in rounds if all(rec.draft_length == k for rec in r.records.values())] or rounds
    refreshes = [r.seconds["refresh_seconds"] / n for r in rounds
                 if (n := sum(rec.refreshed for rec in r.records.values()))]
    return {"verify_s": median(r.seconds["verify_seconds"] + r.seconds["rollback_seconds"] for r in whole),
            "draft_step_s": median(r.seconds["draft_seconds"] / max(r.draft_length, 1) for r in whole),
            "refresh_s": median(refreshes) if refreshes else 0.0}


def batch_costs(report: dict, args) -> dict:
    """Per batch size, the measured rounds as ``experiments/gpu_check.py --model-from`` reads them (its ``costs``:
    a ``RoundCosts`` of the rift-dyn rows at each measured length, verify widths 1 (batched greedy's step) and
    k + 1, and the full-cache draft's step beside it); ``batch`` says how many rows each round served, so the
    modelled tokens/s of a sequence times ``batch`` is the batch's."""
    from rift_ada.joint.costs import RoundCosts

    out = {}
    for b in args.batch_sizes:
        rows = [(entry["input_tokens"], batch) for entry in report["lengths"] for batch in entry["batches"]
                if batch["batch"] == f"low x{b}" and {"greedy_step_s", "full", "rift_dyn"} <= set(batch["round_costs"])]
        if not rows:
            continue
        rows.sort(key=lambda x: x[0])
        costs = RoundCosts(lengths=tuple(n for n, _ in rows), blocks=(1, args.draft_length + 1),
                           verify_s=tuple((c["round_costs"]["greedy_step_s"], c["round_costs"]["rift_dyn"]["verify_s"])
                                          for _, c in rows),
                           draft_s=tuple(c["round_costs"]["rift_dyn"]["draft_step_s"] for _, c in rows),
                           refresh_s=tuple(c["round_costs"]["rift_dyn"]["refresh_s"] for _, c in rows),
                           budget=args.budget, steps=args.batch_step)
        out[f"{args.drafter}@batch{b}"] = {"rift": costs.to_dict(), "batch": b,
                                           "full_draft_s": [c["round_costs"]["full"]["draft_step_s"] for _, c in rows]}
    return out
