"""Train a learned scorer for the draft's cache: what to keep, learned from where the continuation attends.

    python experiments/train_scorer.py                       # the shipped pair; writes runs/scorer/scorer.pt
    python -m rift_ada.evaluate --policy rift-stat --budget 256 --scorer runs/scorer/scorer.pt --source-dir pip

1. Target continuations (greedy) of --train-prompts training prompts (every task format, the standard library's
   training split), stored in <output-dir>/targets (trainers/compressibility.py's format; reused when present).
2. Examples: a dense pass of the frozen draft over prompt + continuation; at the prompt's end and every --stride
   generated tokens, per layer and KV head, the scorer's features (from the observation queries) against the
   attention the next --horizon queries pay to each earlier key (trainers/scorer.py).
3. Training (a small MLP shared by every layer and head), with held-out acceptance length (AL) of rift-stat at
   --budget-fraction on --curve-prompts prompts of --source-dir (code the models never saw) every --eval-every steps
   in W&B, against SnapKV's (the default scorer) on the same prompts.
4. The table (--table-prompts prompts of --source-dir, --temperatures): rift-stat AL with SnapKV at each --lookaheads
   value and with the learned scorer; rift-dyn AL with SnapKV at --period and 2x --period, and with the learned
   scorer at 2x --period. <output-dir>/results.json and table.md; each row is a unit of <output-dir>/state (a rerun
   resumes).

    python experiments/train_scorer.py --scorer experiments/results/scorer/scorer.pt --temperatures 1 0 \
        --output-dir runs/scorer-table          # the table alone, for a scorer trained before (no training)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import mean

from rift_ada.cli import ArgumentParser, add_model_options, add_runtime_options, apply_runtime, fail, require_positive


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed")
    add_runtime_options(p)
    d = p.add_argument_group("data")
    d.add_argument("--train-prompts", type=int, default=48)
    d.add_argument("--input-tokens", type=int, default=2048, help="prompt length of training and held-out prompts")
    d.add_argument("--continuation-tokens", type=int, default=128, help="target tokens after each training prompt")
    d.add_argument("--stride", type=int, default=32, help="generated tokens between scoring points")
    d.add_argument("--points", type=int, default=3, help="scoring points per prompt (the prompt's end first)")
    d.add_argument("--horizon", type=int, default=128, help="queries after a point whose attention is the target")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--batch", type=int, default=24, help="examples (prompt, point, layer, head) per step")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--hidden", type=int, default=32)
    e = p.add_argument_group("evaluation")
    e.add_argument("--source-dir", default="pip", help="held-out code (a folder or an installed package's name)")
    e.add_argument("--task", default="low", help="task family of the held-out prompts")
    e.add_argument("--budget-fraction", type=float, default=0.125, help="the draft cache's budget, of the input")
    e.add_argument("--new-tokens", type=int, default=128)
    e.add_argument("--eval-every", type=int, default=150, help="in-run held-out AL every this many steps (0: off)")
    e.add_argument("--curve-prompts", type=int, default=4)
    e.add_argument("--curve-temperature", type=float, default=1.0)
    e.add_argument("--table-prompts", type=int, default=8)
    e.add_argument("--temperatures", type=float, nargs="+", default=[1.0], help="the table's (default: %(default)s)")
    e.add_argument("--lookaheads", type=int, nargs="+", default=[0, 64, 128, 192, 256],
                   help="SnapKV lookaheads of the table's baseline rows (64: the default)")
    e.add_argument("--period", type=int, default=32, help="rift-dyn's default refresh period")
    e.add_argument("--draft-length", type=int, default=11)
    e.add_argument("--scorer", default=None,
                   help="a trained scorer file: skip steps 1-3 and make the table with it")
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default="runs/scorer")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--wandb-project", default="rift-ada")
    o.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    args = p.parse_args(argv)
    require_positive(p, args, ("train_prompts", "input_tokens", "continuation_tokens", "stride", "points", "horizon",
                               "steps", "batch", "hidden", "new_tokens", "curve_prompts", "table_prompts", "period",
                               "draft_length"))
    if not 0 < args.budget_fraction <= 1 or args.lr <= 0 or args.eval_every < 0:
        p.error("--budget-fraction must be in (0, 1], --lr > 0 and --eval-every >= 0")
    if min(args.lookaheads) < 0 or min(args.temperatures) < 0:
        p.error("--lookaheads and --temperatures must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        apply_runtime(args)
        return _main(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)


def _main(args) -> int:
    from rift_ada.data.sources import source_folder
    from rift_ada.models import load_pair
    from rift_ada.resume import RunState, config_of, write_json
    from rift_ada.trainers import compressibility as C
    from rift_ada.trainers import scorer as S
    from rift_ada.trainers.compressibility_eval import HeldOut, eval_prompts
    from rift_ada.trainers.wandb_logging import ResumableRun

    out, t_start = Path(args.output_dir), time.time()
    state = RunState(out / "state")
    config = config_of(args, ("output_dir", "threads", "wandb_project", "wandb_mode"))
    state.check_config(config, "delete --output-dir's state folder to start over, or choose another --output-dir")
    source = source_folder(args.source_dir) if args.source_dir not in (None, "stdlib") else None
    if args.scorer is not None and not Path(args.scorer).is_file():
        raise FileNotFoundError(f"--scorer {args.scorer!r} is not a file (a scorer.pt this script wrote)")
    pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype)
    samples = None if args.scorer else C.target_outputs(pair, out / "targets", False, args.target, args.train_prompts,
                                                        args.input_tokens, args.continuation_tokens, 1, 0.0, args.seed)
    held = HeldOut(task=args.task, prompts=args.table_prompts, input_tokens=args.input_tokens,
                   new_tokens=args.new_tokens, draft_length=args.draft_length, period=args.period, budgets=(),
                   temperatures=tuple(args.temperatures), seed=args.seed)
    prompts = eval_prompts(pair.tokenizer, held, source)
    budget = max(2, round(args.budget_fraction * mean(len(x) for x in prompts)))
    run = ResumableRun(state.path("wandb.json"), project=args.wandb_project, mode=args.wandb_mode, dir=str(out),
                       config=config, job_type="train_scorer")
    run.define_metric("scorer/*", step_metric="scorer/step")

    def al(ids, temperature: float, scorer: str = "snapkv", lookahead: int = 64, period: int | None = None) -> float:
        return acceptance(pair, ids, budget, temperature, scorer, lookahead, period, args)

    scorer_file = Path(args.scorer) if args.scorer else out / "scorer.pt"
    curve_ids = prompts[:args.curve_prompts]
    cfg = S.ScorerConfig(stride=args.stride, points=args.points, horizon=args.horizon, steps=args.steps,
                         batch=args.batch, lr=args.lr, hidden=args.hidden, seed=args.seed)

    def train() -> dict:
        baseline = state.unit("curve-snapkv", lambda: {"al": al(curve_ids, args.curve_temperature)})["al"]
        data = S.examples(pair.draft, samples, cfg)
        t0 = time.time()
        curve = (lambda s: {"al_rift_stat": al(curve_ids, args.curve_temperature, str(scorer_file))}) \
            if args.eval_every else None
        log = lambda point: run.log({f"scorer/{k}": v for k, v in point.items()} | {"scorer/al_snapkv": baseline})  # noqa: E731
        scorer, history = S.train_scorer(data, cfg, curve, args.eval_every, log, lambda s: s.save(scorer_file))
        keep = budget - round(budget * 0.5)
        return {"history": history, "train_seconds": time.time() - t0, "examples": len(data),
                "coverage": {"snapkv_raw": S.coverage(None, data, keep), "learned": S.coverage(scorer, data, keep)}}

    trained = {"history": [], "train_seconds": 0.0, "examples": 0, "coverage": None} if args.scorer else \
        state.unit("train", train)
    if not scorer_file.is_file():
        raise RuntimeError(f"{scorer_file} is missing though the state says training finished: delete "
                           f"{out / 'state'} and rerun")
    rows = []
    for temp in args.temperatures:
        configs = [(f"rift-stat snapkv lookahead {la}", "snapkv", la, None) for la in args.lookaheads]
        configs += [("rift-stat learned", str(scorer_file), 64, None),
                    (f"rift-dyn snapkv period {args.period}", "snapkv", 64, args.period),
                    (f"rift-dyn snapkv period {2 * args.period}", "snapkv", 64, 2 * args.period),
                    (f"rift-dyn learned period {2 * args.period}", str(scorer_file), 64, 2 * args.period)]
        for name, sc, la, period in configs:
            r = state.unit(f"table-t{temp:g}-{name.replace(' ', '-')}",
                           lambda sc=sc, la=la, period=period: {"al": al(prompts, temp, sc, la, period)})
            rows.append({"temperature": temp, "row": name, "al": r["al"]})
    results = {"budget": budget, "prompts": len(prompts), "source_dir": args.source_dir, "task": args.task,
               "rows": rows, **trained, "total_seconds": time.time() - t_start, "scorer": str(scorer_file)}
    write_json(out / "results.json", results)
    table = format_table(rows, budget, len(prompts))
    (out / "table.md").write_text(table + "\n")
    import wandb

    run.log({"scorer/table": wandb.Table(columns=["temperature", "row", "al"],
                                         data=[[r["temperature"], r["row"], r["al"]] for r in rows])})
    run.finish()
    print(table)
    if trained["coverage"] is not None:
        print(f"\nscorer: {scorer_file} | training {trained['train_seconds']:.0f} s | attention the kept slots cover "
              f"(training examples): SnapKV's raw scores {trained['coverage']['snapkv_raw']:.3f}, learned "
              f"{trained['coverage']['learned']:.3f}")
    return 0


def acceptance(pair, prompts, budget: int, temperature: float, scorer: str, lookahead: int, period, args) -> float:
    """Mean AL over ``prompts`` of rift-stat (``period`` None) or rift-dyn with ``scorer``, static draft step."""
    from rift_ada.evaluate import evaluate
    from rift_ada.metrics import acceptance_length
    from rift_ada.policies import make_policy
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    policy = make_policy("rift-dyn" if period else "rift-stat", budget=budget, scorer=scorer,
                         lookahead=lookahead, period=period)
    dec = SpeculativeDecoder.for_pair(pair, policy.layout, Decoding(args.draft_length, temperature, seed=args.seed,
                                                                    draft_step="static"))
    results = evaluate(dec, prompts, policy.controller, args.new_tokens).results
    return mean(acceptance_length(r.rounds) for r in results)


def format_table(rows: list[dict], budget: int, prompts: int) -> str:
    temps = sorted({r["temperature"] for r in rows}, reverse=True)
    names = list(dict.fromkeys(r["row"] for r in rows))
    al = {(r["row"], r["temperature"]): r["al"] for r in rows}
    lines = [f"AL at budget {budget}, {prompts} held-out prompts",
             "| draft cache | " + " | ".join(f"T = {t:g}" for t in temps) + " |", "|---|" + "---|" * len(temps)]
    lines += [f"| {n} | " + " | ".join(f"{al[n, t]:.2f}" for t in temps) + " |" for n in names]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
