"""The paper regime's refresh tradeoff checked on the real decoder: the run's prompts, decoded and replayed.

    python experiments/regime_check.py --run runs/paper     # T = 1, every prompt, the controllers trained at 8K

``experiments/paper_regime.py`` replays refresh schedules on its tables. This decodes the same prompts (rebuilt from
the run's ``summary.json`` options) with the real decoder (``SpeculativeDecoder`` at the run's layout, static steps,
each prompt's prefill made once and copied for every schedule) under periodic refresh at ``--periods`` and every
exported controller in ``--controllers``, and replays each schedule on the prompt's table (``--episodes`` replays
when sampling). Per prompt and schedule it stores the real decoder's AL and refreshes per 1K tokens beside the
replay's (their mean over episodes and the 95% range of one episode: where a single decode should land), both over
the tokens the real decode shares with the table's continuation (sampling, a decode draws its own continuation: one
that parts from the table's is compared up to there, and stops after the round that leaves it), and both
points' refresh savings against the run's replayed periodic curve at matched AL; resumable per unit in
``<run>/check-t<T>/``; prints the table. A real decode of 4K tokens after a 32K prompt costs about
5 minutes on 2 cores at an AL near 11 (a schedule that lets the selection go stale costs several times that).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

from rift_ada.cli import ArgumentParser, add_runtime_options, apply_runtime, fail, require_positive


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/paper", help="a paper_regime output folder (its summary.json and tables)")
    p.add_argument("--temperature", type=float, default=1.0, help="which of the run's temperatures (default 1)")
    p.add_argument("--prompts", type=int, default=None, help="the run's first N prompts (default: all)")
    p.add_argument("--periods", type=int, nargs="*", default=[64], help="periodic refresh every N tokens")
    p.add_argument("--controllers", nargs="*", default=["experiments/results/controller-8k"],
                   help="folders of exported controllers (controller-*.json / .pt) or files")
    p.add_argument("--episodes", type=int, default=64, help="replays per table when sampling")
    add_runtime_options(p, threads=2)
    args = p.parse_args(argv)
    require_positive(p, args, ["episodes"] + (["prompts"] if args.prompts is not None else []))
    if any(n < 1 for n in args.periods):
        p.error("--periods must be >= 1")
    return args


def run_options(run: Path, temperature: float) -> dict:
    """The paper_regime options ``run`` was made with; ValueError when it holds no finished run at ``temperature``."""
    path = run / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run experiments/paper_regime.py --output-dir {run} first")
    opts = json.loads(path.read_text())["options"]
    if temperature not in opts["temperatures"]:
        raise ValueError(f"{run} was run at temperatures {opts['temperatures']}, not {temperature:g}")
    return opts


def schedules(args) -> dict:
    from rift_ada.refresh import PeriodicController, load_controllers

    return {**{f"periodic-{n}": PeriodicController(n) for n in args.periods}, **load_controllers(args.controllers)}


def check(decoder, ids, table, controller, opts: dict, episodes: int) -> dict:
    """One schedule on one prompt: the real decoder's AL and refreshes per 1K tokens, and the replay's, over the
    tokens the real decode shares with the table's continuation."""
    from rift_ada.replay.fidelity import al, real_rounds, refreshes, replayed, within

    k, new = opts["draft_length"], opts["max_new_tokens"]
    theirs = [int(t) for t in table.tokens]
    # Sampling, the real decode draws its own continuation and the replay follows the table's (its range covers the
    # rejection rule's coin flips on that one continuation): the two are compared where they are the same text, and
    # the decode stops once it leaves it.
    real = real_rounds(decoder, ids, new, controller, None, opts["refresh_grid"], follow=theirs)
    ours = list(decoder.result.tokens)
    shared = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    real = within(real, shared)
    reps = [within(r, shared) for r in replayed(table, k, controller, None, episodes, opts["seed"])]
    if not real:
        raise ValueError(f"the real decode left the table's continuation in its first round ({shared} tokens shared)")
    per_k = 1000 / shared
    rep_al, rep_ref = [al(r) for r in reps], [refreshes(r) * per_k for r in reps]
    return {"real_al": al(real), "real_refreshes_per_1k": refreshes(real) * per_k, "tokens": len(ours),
            "tokens_shared_with_table": shared, "replay_al": float(np.mean(rep_al)),
            "replay_al_range": [float(x) for x in np.percentile(rep_al, [2.5, 97.5])],
            "replay_refreshes_per_1k": float(np.mean(rep_ref)),
            "replay_refreshes_range": [float(x) for x in np.percentile(rep_ref, [2.5, 97.5])]}


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Path(args.run)
    try:
        opts = run_options(run, args.temperature)
        apply_runtime(args)
        from rift_ada.layout import CacheLayout
        from rift_ada.models import load_pair
        from rift_ada.studies.regime import regime_prompts, table_name, tables_folder
        from rift_ada.replay import ReplayTable
        from rift_ada.resume import RunState
        from rift_ada.speculative import Decoding, SpeculativeDecoder

        learned = schedules(args)
        n = opts["prompts"] if args.prompts is None else min(args.prompts, opts["prompts"])
        pair = load_pair(opts["target"], opts["drafter"], device=args.device, dtype=args.dtype)
        prompts = regime_prompts(pair.tokenizer, {**opts, "prompts": n})[:n]
        folder = tables_folder(run, args.temperature)
        paths = [folder / f"{table_name(i, ids)}.safetensors" for i, ids in enumerate(prompts)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"no table for {missing[0]}: the run's prompts differ from what it stored")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    layout = CacheLayout("rift", budget=opts["budget"], refresh_grid=opts["refresh_grid"], lookahead=opts["lookahead"])
    decoding = Decoding(opts["draft_length"], args.temperature, seed=opts["seed"], draft_step="static",
                        verify_step="static")
    decoder = SpeculativeDecoder.for_pair(pair, layout, decoding)
    decoder.reuse_prefill = True
    state, t0 = RunState(run / f"check-t{args.temperature:g}"), time.time()
    key = {"episodes": args.episodes, "temperature": args.temperature}
    results = {}
    for i, (ids, path) in enumerate(zip(prompts, paths)):
        table = ReplayTable.load(path)
        for name, controller in learned.items():
            print(f"prompt {i}, {name} ...", flush=True)
            results[f"p{i:03d}/{name}"] = state.unit(f"p{i:03d}-{name}", lambda: check(
                decoder, ids, table, controller, opts, args.episodes), key=key)
    summary = summarize(results, learned, run / f"tradeoff-t{args.temperature:g}.csv")
    out = run / f"check-t{args.temperature:g}.json"
    out.write_text(json.dumps({"options": vars(args), "run_options": opts, "units": results, "summary": summary,
                               "seconds": time.time() - t0}, indent=1))
    print(f"\n{n} prompt(s), T = {args.temperature:g}, {opts['input_tokens']} in / {opts['max_new_tokens']} out, "
          f"budget {opts['budget']}: the real decoder against replay (one decode per prompt and schedule)")
    print(f"{'schedule':>14} | {'AL real':>8} {'replay':>7} | {'refr/1K real':>12} {'replay':>7} | "
          "inside replay's range | fewer refreshes than periodic: real, replay")
    for name, r in summary.items():
        saved = " ".join("-" if r[k] is None else f"{100 * r[k]:.1f}%" for k in ("real_savings", "replay_savings"))
        print(f"{name:>14} | {r['real_al']:8.2f} {r['replay_al']:7.2f} | {r['real_refreshes_per_1k']:12.1f} "
              f"{r['replay_refreshes_per_1k']:7.1f} | {r['inside']}/{r['prompts']:<19} | {saved}")
    print(f"written to {out}")
    return 0


def summarize(results: dict, names, tradeoff_csv: Path) -> dict:
    """Per schedule, the mean over prompts of each number; on how many prompts the real decode's AL and refresh count
    both fall inside the replay's 95% range of one episode; and the real and the replayed point's refresh savings
    against the run's replayed periodic curve at matched AL (``rift_ada.tradeoff``, as paper_regime reports them)."""
    from rift_ada.tradeoff import periodic_envelope, refreshes_needed

    curve = None
    if tradeoff_csv.is_file():
        with open(tradeoff_csv) as f:
            rows = [{"family": r["family"], "acceptance_length": float(r["acceptance_length"]),
                     "refreshes_per_1k": float(r["refreshes_per_1k"])} for r in csv.DictReader(f)]
        curve = periodic_envelope(rows)
    out = {}
    for name in names:
        rows = [r for k, r in results.items() if k.split("/", 1)[1] == name]
        inside = sum(lo <= r["real_al"] <= hi and rlo <= r["real_refreshes_per_1k"] <= rhi
                     for r in rows for (lo, hi), (rlo, rhi) in [(r["replay_al_range"], r["replay_refreshes_range"])])
        row = {k: float(np.mean([r[k] for r in rows])) for k in
               ("real_al", "replay_al", "real_refreshes_per_1k", "replay_refreshes_per_1k")}
        for kind in ("real", "replay"):
            need = None if curve is None else refreshes_needed(row[f"{kind}_al"], *curve)
            row[f"{kind}_savings"] = 1.0 - row[f"{kind}_refreshes_per_1k"] / need if need else None
        shared = [r["tokens_shared_with_table"] for r in rows if "tokens_shared_with_table" in r]
        out[name] = {**row, "prompts": len(rows), "inside": int(inside), "tokens_shared_with_table": shared}
    return out


if __name__ == "__main__":
    sys.exit(main())
