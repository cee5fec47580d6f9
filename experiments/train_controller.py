"""Learn when to refresh the draft's RIFT cache from replay tables, and compare every controller family on code it
never saw.

    python experiments/train_controller.py                  # built-in testbed, about 17 minutes on 2 CPU cores
    python experiments/train_controller.py --resume         # after an interruption: continue where it stopped

Defaults: the paper's RIFT-ada setting as far as 2 cores allow: the shipped pair with its external draft, T = 1,
1,024-token prompts of the low, sort and high families, 1,024 new tokens, budget 256 (25%), k = 11, refresh grid 8.

1. Replay tables (``rift_ada.replay``): per training prompt (--prompts-per-source from each of --train-sources,
   six code bases by default) one decode fixes the continuation and one teacher-forced pass of the draft per
   refresh time on the grid gives every later position's acceptance and signals; likewise per held-out prompt
   (--source-dir, default pip's source: a code base nothing here trains or tunes on).
2. A decision tree and a logistic controller imitating the oracle's decisions (the best schedule over a table at
   --label-price, by dynamic programming), on the states random schedules and then the fitted controllers reach
   (DAgger); PPO and DQN (stable-baselines3) trained in the replay environment (``rift_ada/Replay-v0``) per
   refresh-cost weight lambda, --reward tokens or time (PPO first clones the oracle whose cost is that reward, then
   its critic warms up with the clone frozen, then PPO improves on it).
3. Every family across its knob (periodic: period; tree / logistic: decision level; PPO, DQN: lambda) and the
   oracle (--oracle-lams) replayed on the held-out tables: the headline, each figure with a bootstrap interval over
   the prompts, pooled and per task family; the real decoder checks it on --check-prompts of them (paired seeds).
4. Output folder: tradeoff.csv (replayed: refresh savings against periodic at matched AL, share of the oracle's
   saving, AL gain at matched refreshes, with intervals), tradeoff_check.csv, tradeoff.png, tradeoff_time.png,
   metrics.json, controller-<kind>.json/.pt per learned family (``--controller``, ``rift_generate``: no
   scikit-learn or SB3 needed), the tables, an offline W&B run (``wandb sync``).

``--joint`` trains joint controllers (refresh and draft length) on the same tables instead (trainers/joint.py).
Resuming: every table is a file and every other finished unit is stored in <output-dir>/state as soon as it ends;
``--resume`` (same options) redoes the interrupted one and ends as an uninterrupted run would (bit-identical on the
same machine and --threads). Without --resume, a folder holding a previous run is refused (exit 2); --overwrite
deletes its state and results (not its tables or W&B logs) and starts over.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from rift_ada import signals, sweep
from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_knob_options,
                          add_learned_options, add_model_options, add_runtime_options, apply_runtime,
                          decoding_from_args, fail, knob_problem, knob_values, learners_of, options_problem,
                          policy_from_args,
                          require_positive)
from rift_ada.refresh.registry import learned
from rift_ada.resume import config_of, open_state
from rift_ada.trainers import joint
from rift_ada.trainers.controller_job import report, stages, workers
from rift_ada.trainers.controller_job.job import Job


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed", device_map=True)  # an external draft, as in the paper's RIFT-ada setting
    add_cache_options(p, policy=None, budget=256, refresh_grid=8)  # 25% of the prompt, on the tables' grid
    add_decoding_options(p, max_new_tokens=1024)
    p.set_defaults(temperature=1.0, draft_step="static", verify_step="static")  # the paper samples; the fast path
    add_runtime_options(p)
    add_job_options(p)
    # Every registered rule with a knob (--periods, --acc-thresholds, ...). The hand rules are off by default.
    # The sweep is replayed on the held-out tables, so periodic's curve is cheap to draw densely.
    add_knob_options(p.add_argument_group("tradeoff sweep"), periods=[8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256],
                     acc_thresholds=[], entropy_quantiles=[])
    # Every learned kind's knob and training options (--tree-decisions, --lams, --ppo-timesteps, ...) and --learners.
    add_learned_options(p.add_argument_group("learned controllers"))
    joint.add_joint_options(p)  # --joint: refresh and draft length (trainers/joint.py)
    preset, _ = p.parse_known_args(argv)
    if preset.preset in PRESETS:  # an unknown one is refused by the full parse below
        p.set_defaults(**PRESETS[preset.preset])
    args = p.parse_args(argv)
    require_positive(p, args, ("budget", "max_new_tokens", "prompts_per_source", "eval_prompts", "eval_seeds",
                               "resamples",
                               "tables_per_prompt", "train_new_tokens", "dagger_rounds", "label_episodes",
                               "draft_length", "threads", "n_envs", "workers", "oracle_episodes"))
    if any(x < 0 for x in args.oracle_lams) or args.refresh_cost < 0 or args.label_price < 0:
        p.error("prices and the refresh cost must be >= 0")
    problem = knob_problem(args) or knob_problem(args, learned()) or options_problem(args)
    if problem or not 1 <= args.behaviour_periods[0] <= args.behaviour_periods[1]:
        p.error(problem or "--behaviour-periods needs 1 <= LO <= HI")
    try:
        learners_of(args)
    except ValueError as e:
        p.error(str(e))
    if problem := report.check_problem(args):
        p.error(problem)
    if args.source_dir == "stdlib":
        args.source_dir = None
    args.output_dir = args.output_dir or ("runs/joint" if args.joint else "runs/controller")
    try:
        joint.check_joint_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def add_job_options(p) -> None:
    """The options of the job itself: prompts, training data and environments, the oracle, output."""
    m = p.add_argument_group("prompts")
    m.add_argument("--task", default="low,sort,high",
                   help="task family: low, mixed, sort, high, or a comma-separated mix (low,sort,high: copying, "
                        "reordered retrieval, and novel code where a refresh does not pay)")
    m.add_argument("--input-tokens", type=int, default=1024)
    m.add_argument("--train-sources", default=",".join(TRAIN_SOURCES),
                   help="code bases of the training prompts: stdlib (its training split), installed packages or "
                        "folders, comma-separated (default: %(default)s)")
    m.add_argument("--prompts-per-source", type=int, default=2, help="training prompts from each code base")
    m.add_argument("--source-dir", default="pip",
                   help="the held-out code base (a package or a folder; never among --train-sources): the sweep's "
                        "prompts. 'stdlib' takes the standard library's held-out split")
    report.add_eval_options(m)  # --eval-prompts, --eval-seeds, the real decoder's check, the intervals
    t = p.add_argument_group("training")
    t.add_argument("--tables-per-prompt", type=int, default=1,
                   help="sampled continuations (tables) per training prompt when sampling")
    t.add_argument("--train-new-tokens", type=int, default=512,
                   help="continuation tokens of the training tables, at most --max-new-tokens (the signals are local; "
                        "a table costs the square of its length; the held-out prompts decode --max-new-tokens)")
    t.add_argument("--label-price", type=float, default=4.0,
                   help="the refresh price (in target rounds) of the oracle whose decisions the tree and the logistic "
                        "controller imitate")
    t.add_argument("--dagger-rounds", type=int, default=2,
                   help="fits per controller: on random schedules' states, then again adding the states the last "
                        "fit reaches")
    t.add_argument("--label-episodes", type=int, default=4, help="replays per table and DAgger round")
    t.add_argument("--behaviour-periods", type=int, nargs=2, default=[16, 192], metavar=("LO", "HI"),
                   help="the first round's replays refresh after a period drawn from LO-HI tokens, a new one after "
                        "every refresh")
    t.add_argument("--reward", default="tokens", choices=["tokens", "time"],
                   help="what PPO / DQN maximise: tokens = accepted drafts - lambda x --refresh-cost per refresh; time "
                        "= modelled tokens per second (each round's time from costs measured once on this machine, "
                        "lambda weighting the refresh time; see envs/refresh_env.py)")
    t.add_argument("--refresh-cost", type=float, default=2.0,
                   help="cost of one refresh in draft-token equivalents (--reward tokens)")
    t.add_argument("--n-envs", type=int, default=8, help="replay envs stepping together for PPO / DQN")
    t.add_argument("--no-shaping", dest="shaping", action="store_false",
                   help="PPO / DQN on the plain reward (default: shaped by the oracle's cost to go, envs/replay_env.py)")
    t.add_argument("--no-clone", dest="clone", action="store_false",
                   help="PPO from a random policy (default: it first clones the oracle's decisions the tree learns "
                        "from, trainers/ppo.py)")
    t.add_argument("--workers", type=int, default=2,
                   help="processes building tables and decoding the sweep's points side by side, each with its own "
                        "copy of the pair (one per core; 1: all in this process)")
    stages.add_oracle_options(p.add_argument_group("oracle"))
    o = p.add_argument_group("output")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--output-dir", default=None, help="default runs/controller (--joint: runs/joint)")
    o.add_argument("--wandb-project", default="rift-ada")
    o.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    r = o.add_mutually_exclusive_group()
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir from its last finished unit (same options required)")
    r.add_argument("--overwrite", action="store_true",
                   help="delete a previous run's state and results in --output-dir first (its tables and W&B logs "
                        "stay)")
    o.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                   help="defaults for a setting, each overridable by its own option: cpu (this CPU, the testbed, "
                        "minutes) or paper (32K-token prompts, 4K new tokens, 8K budget, k = 11, T = 1, periods up to "
                        "4K: for a GPU and a real --target / --drafter pair)")


# Training code bases: stdlib's training split and five of the project's dependencies (installed wherever it is).
TRAIN_SOURCES = ("stdlib", "numpy", "scipy", "sklearn", "transformers", "matplotlib")


PRESETS = {  # defaults per setting (an option given wins); "paper": the RIFT paper's RIFT-ada setting
    "cpu": {},
    "paper": {"input_tokens": 32768, "max_new_tokens": 4096, "budget": 8192, "draft_length": 11, "temperature": 1.0,
              "task": "low,sort", "periods": [64, 128, 256, 512, 1024, 2048, 4096]},
}


# A finished run's files (refused or deleted as "a previous run"); options that do not change its results.
RESULT_FILES = ("tradeoff.csv", "tradeoff_check.csv", "tradeoff.png", "tradeoff_time.png", "metrics.json",
                *(f"controller-{c.kind}{c.suffix}" for c in learned()), *joint.RESULT_FILES)
SESSION_OPTIONS = ("output_dir", "resume", "overwrite", "threads", "wandb_project", "wandb_mode", "workers")


def main(argv=None) -> int:
    from rift_ada import distributed

    if distributed.launched_world_size() > 1:
        # Every process would run the whole job and write the same files (its tables can shard: rift_ada.replay).
        err = ValueError("experiments/train_controller.py runs as one process: run it without torchrun "
                         "(build its tables with torchrun -m rift_ada.replay build first, if you like)")
        return fail(err) if distributed.is_main() else 2
    args = parse_args(argv)
    out = Path(args.output_dir)
    t_start = time.time()
    config = config_of(args, SESSION_OPTIONS)
    try:  # before anything slow: a refused option or --output-dir costs nothing
        apply_runtime(args)
        layout = policy_from_args(args, "rift-ada", controller="never").layout
        state = open_state(out, config, args.resume, args.overwrite, RESULT_FILES)
    except ValueError as e:
        return fail(e)
    if state.has("done"):
        print(f"{out} holds a finished run; nothing to resume (results: {out / 'tradeoff.csv'})")
        return 0
    try:
        pair, train, evals = stages.load(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    done = sorted(p.stem for p in state.folder.glob("*.json") if p.stem not in ("config", "wandb"))
    if args.resume and done:
        print(f"resuming {out}: {len(list((out / 'tables').glob('*.safetensors')))} tables and {len(done)} finished "
              f"units ({', '.join(done)}) kept", file=sys.stderr)
    from rift_ada.trainers.wandb_logging import ResumableRun

    # The W&B run's id lives in the state, so a resumed job logs to the same run.
    run = ResumableRun(state.path("wandb.json"), project=args.wandb_project, mode=args.wandb_mode, dir=str(out),
                       config=config, job_type="train_controller")
    decoding = decoding_from_args(args)
    ctx = workers.Context(pair, decoding)
    setting = workers.Setting(args.target, args.drafter, args.device, args.dtype, args.threads, decoding)
    try:
        costs = stages.costs(state, ctx.decoder(layout), train[0][1], args.max_new_tokens)
        train_tables, heldout_tables, tables_s = stages.tables(out, pair, args, layout, decoding, train, evals)
    except ValueError as e:
        return fail(e)
    print(f"cost model: draft step {1e3 * costs.draft_step_s:.2f} ms, verify {1e3 * costs.verify_s:.2f} ms, refresh "
          f"{1e3 * costs.refresh_s:.2f} ms; {len(train_tables)} training and {len(heldout_tables)} held-out tables "
          f"({tables_s:.0f} s)", file=sys.stderr)
    if args.joint:
        return joint.finish(out, state, run, args, pair, layout, decoding, train_tables, heldout_tables)
    t0 = time.time()
    job = Job(state, run, args, train_tables, costs)
    trained = stages.train(job, learners_of(args))
    training_s = time.time() - t0
    observed = job.states if job.states is not None else np.zeros((0, len(signals.NAMES)), np.float32)
    values = knob_values(args)  # the real decoder's periods are replayed too, so each check has its replay
    values["periodic"] = sorted(set(values["periodic"]) | set(args.check_periods if args.check_prompts else []))
    points = stages.sweep_points(values, observed, trained)
    full, oracle = stages.replayed_points(state, heldout_tables, args)
    replayed = stages.replay_sweep(state, points, heldout_tables, args)
    checked = stages.check_points(points, args)
    results = stages.run_sweep(state, checked, ctx, setting, layout, evals[:args.check_prompts], args)
    timings = {"tables_s": tables_s, "training_s": training_s, "check_s": sum(r["seconds"] for r in results)}
    data = {"train_sources": sorted({src for src, _ in train}), "train_tables": len(train_tables),
            "heldout_tables": len(heldout_tables), "knobs": {k: [x for x, _ in pts] for k, pts in trained.items()}}
    report.finish(out, state, run, args, report.Swept([sweep.full_point()] + points + [p for p, _ in oracle],
                                                      [full] + replayed + [c for _, c in oracle]),
                  report.Swept(checked, results), list(trained), timings, data, costs, t_start)
    return 0


if __name__ == "__main__":  # forkserver workers: keep this guard
    sys.exit(main())
