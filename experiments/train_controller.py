"""Learn when to refresh the draft's RIFT cache, and compare every controller family on a tradeoff curve.

    python experiments/train_controller.py                  # built-in testbed, about 20 minutes on 2 CPU cores
    python experiments/train_controller.py --resume         # after an interruption: continue where it stopped

Defaults: the paper's RIFT-ada setting as far as 2 cores allow: the shipped pair with its external draft, T = 1,
1,024-token prompts of the low, sort and high families, 1,024 new tokens, budget 256 (25%), k = 11.

1. Counterfactual data on training prompts: along trajectories that refresh after random periods, fork the decoder,
   refresh now / a round later / never, and compare the accepted tokens of the next rounds (--label wait: does
   waiting a round cost acceptance?).
2. A decision tree and a logistic controller fitted on those labels (learning curves to W&B); with --learners, per
   refresh-cost weight lambda, a controller of each SB3 learner (PPO, DQN) trained in RefreshEnv with --reward tokens
   (accepted drafts - lambda x refresh cost) or time (modelled tokens per second, rift_ada.costs).
3. Every family swept across its knob on held-out prompts (periodic: period; tree / logistic: decision level; the
   hand rules when their options are given; PPO, DQN: lambda; the hindsight oracle: refresh price), giving
   acceptance length (AL) and modelled tokens per second versus refreshes per 1K tokens, over --eval-seeds seeds.
4. Output folder: tradeoff.csv (with each family's share of the oracle's saving), tradeoff.png (AL vs refreshes),
   tradeoff_time.png (modelled tokens/s vs refreshes), metrics.json (with the cost model and each point's modelled
   tokens/s), the best learned controller exported (controller.json or controller.pt, loadable without
   scikit-learn or stable-baselines3), and a W&B run (offline by default: ``wandb sync
   <output-dir>/wandb/offline-run-*`` uploads it later).
5. Prints, per learned family, the % fewer refreshes than periodic refresh at matched AL, the AL gain at a matched
   refresh count and the share of the oracle's saving.

Resuming: each finished unit of work (the cost measurement, one prompt's counterfactual data, the logistic fit, one
PPO or DQN run per lambda, one sweep point) is stored in <output-dir>/state as soon as it ends. After a kill at any point, ``--resume`` (with the
same options) loads the finished units, redoes the interrupted one from its start and ends with the same
tradeoff.csv as an uninterrupted run (every unit is seeded on its own; bit-identical on the same machine and
--threads). The W&B run resumes under the same id (offline: one offline-run-* folder per session, which ``wandb
sync`` uploads in order as one run). Without --resume, an output folder holding a previous run is refused (exit 2);
--overwrite deletes its state and results (not its W&B logs) and starts over.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from controller_job import report, stages, workers
from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_model_options,
                          add_runtime_options, apply_runtime, decoding_from_args, fail, policy_from_args,
                          require_positive)
from rift_ada.sweep import add_knob_options, knob_problem
from rift_ada.trainers.resume import config_of, open_state, write_json


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed", device_map=True)  # an external draft, as in the paper's RIFT-ada setting
    add_cache_options(p, policy=None, budget=256)  # a RIFT layout (25% of the prompt); the controllers are learned
    add_decoding_options(p, max_new_tokens=1024)
    p.set_defaults(temperature=1.0)  # the paper's RIFT-ada setting samples
    add_runtime_options(p)
    m = p.add_argument_group("task")
    m.add_argument("--task", default="low,sort,high",
                   help="task family: low, mixed, sort, high, or a comma-separated mix (low,sort,high: copying, "
                        "reordered retrieval, and novel code where a refresh does not pay)")
    m.add_argument("--input-tokens", type=int, default=1024)
    m.add_argument("--train-prompts", type=int, default=4,
                   help="prompts for counterfactual data and PPO (4: two workers take two each)")
    m.add_argument("--eval-prompts", type=int, default=3, help="held-out prompts for the tradeoff curves")
    m.add_argument("--eval-seeds", type=int, default=1,
                   help="decoder seeds per held-out prompt and tradeoff point (sampling makes AL noisy; the table "
                        "reports the mean and the spread over seeds)")
    t = p.add_argument_group("training")
    t.add_argument("--horizon", type=int, default=3, help="rounds per counterfactual branch")
    t.add_argument("--label", default="wait", choices=["wait", "now"],
                   help="what a counterfactual label asks: wait = does refreshing now beat refreshing --label-delay "
                        "rounds later (when); now = does it beat not refreshing (whether; trainers/counterfactual.py)")
    t.add_argument("--label-delay", type=int, default=1, help="rounds the 'later' branch waits (--label wait)")
    t.add_argument("--label-temperature", type=float, default=0.0,
                   help="temperature of the counterfactual branches (the trajectories sample at --temperature): 0 "
                        "compares what the cache covers without the noise of sampled tokens; -1: --temperature")
    t.add_argument("--label-every", type=int, default=1, help="label every n-th round of the data trajectories")
    t.add_argument("--behaviour-periods", type=int, nargs=2, default=[32, 128], metavar=("LO", "HI"),
                   help="the data trajectories refresh after a period drawn from LO-HI tokens, a new one after every "
                        "refresh (so each prompt passes through fresh, expiring and stale selections many times)")
    t.add_argument("--states-per-prompt", type=int, default=64,
                   help="most labelled states per training prompt, spread over its generation")
    t.add_argument("--reward", default="tokens", choices=["tokens", "time"],
                   help="what PPO / DQN maximise: tokens = accepted drafts - lambda x --refresh-cost per refresh; time "
                        "= modelled tokens per second (each round's time from costs measured once on this machine, "
                        "lambda weighting the refresh time; see envs/refresh_env.py)")
    t.add_argument("--refresh-cost", type=float, default=2.0,
                   help="cost of one refresh in draft-token equivalents (--reward tokens; also the default "
                        "--label-margin)")
    t.add_argument("--label-margin", type=float, default=None,
                   help="label a state 'refresh' when refreshing gains more accepted tokens than this over the "
                        "horizon (default: the refresh cost)")
    t.add_argument("--tree-depth", type=int, default=3, help="depth of the decision-tree controller")
    t.add_argument("--ppo-timesteps", type=int, default=1024,
                   help="PPO environment steps (rounds) per lambda, rounded up to whole rollouts (128 x --n-envs)")
    t.add_argument("--learners", default="none",
                   help="comma-separated stable-baselines3 learners to train per lambda beside the logistic "
                        "controller: ppo, dqn (e.g. ppo,dqn), or none")
    t.add_argument("--dqn-timesteps", type=int, default=2000,
                   help="DQN environment steps (rounds) per lambda, rounded up to a multiple of --n-envs")
    t.add_argument("--lams", type=float, nargs="+", default=[4.0],
                   help="refresh-cost weights for the learners (their knob on the tradeoff curve)")
    t.add_argument("--workers", type=int, default=2,
                   help="processes running the counterfactual prompts and the sweep's points side by side, each "
                        "with its own copy of the pair (one per core; 1: all in this process)")
    t.add_argument("--n-envs", type=int, default=2, help="RefreshEnvs stepping together for PPO / DQN")
    t.add_argument("--vec-env", default="dummy", choices=["dummy", "subproc"],
                   help="dummy: the envs step in this process, sharing its models; subproc: one worker process per env, "
                        "each loading its own models (experiments/bench_env.py measures both)")
    k = p.add_argument_group("tradeoff sweep")
    # Every registered kind with a knob (--periods, --acc-thresholds, ...). The hand rules are off by default (20
    # minutes on 2 cores hold periodic refresh, the learned controllers and the oracle at T = 1 and 1,024 tokens).
    add_knob_options(k, periods=[16, 32, 64], acc_thresholds=[], entropy_quantiles=[])
    k.add_argument("--logistic-thresholds", type=float, nargs="*", default=[],
                   help="the logistic controller's decision thresholds swept (none: leave it out)")
    k.add_argument("--tree-decisions", type=float, nargs="*", default=[0.25, 0.5],
                   help="the tree controller's decision levels swept (none: leave it out)")
    k.add_argument("--oracle-lams", type=float, nargs="*", default=[4.0],
                   help="the hindsight oracle (rift_ada/oracle.py) at these refresh prices in accepted tokens: its "
                        "points on the tradeoff curve show the saving a controller could reach (none: skip it)")
    k.add_argument("--oracle-beam", type=int, default=2, help="oracle: branches kept at each decision")
    k.add_argument("--oracle-block", type=int, default=4, help="oracle: rounds between decisions")
    o = p.add_argument_group("output")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--output-dir", default="runs/controller")
    o.add_argument("--wandb-project", default="rift-ada")
    o.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    r = o.add_mutually_exclusive_group()
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir from its last finished unit (same options required)")
    r.add_argument("--overwrite", action="store_true",
                   help="delete a previous run's state and results in --output-dir first (its W&B logs stay)")
    o.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                   help="defaults for a setting, each overridable by its own option: cpu (this CPU, the testbed, "
                        "minutes) or paper (32K-token prompts, 4K new tokens, 8K budget, k = 11, T = 1, periods up to "
                        "4K: for a GPU and a real --target / --drafter pair)")
    preset, _ = p.parse_known_args(argv)
    if preset.preset in PRESETS:  # an unknown one is refused by the full parse below
        p.set_defaults(**PRESETS[preset.preset])
    args = p.parse_args(argv)
    require_positive(p, args, ("budget", "max_new_tokens", "train_prompts", "eval_prompts", "eval_seeds", "horizon",
                               "label_delay", "states_per_prompt", "tree_depth",
                               "ppo_timesteps", "dqn_timesteps", "draft_length", "label_every", "threads", "n_envs", "workers",
                               "oracle_beam", "oracle_block"))
    if any(x < 0 for x in args.lams + args.oracle_lams) or args.refresh_cost < 0:
        p.error("lambdas and the refresh cost must be >= 0")
    if knob_problem(args) or any(not 0 < x < 1 for x in args.logistic_thresholds + args.tree_decisions):
        p.error(knob_problem(args) or "--logistic-thresholds and --tree-decisions must lie in (0, 1)")
    if not 1 <= args.behaviour_periods[0] <= args.behaviour_periods[1]:
        p.error("--behaviour-periods needs 1 <= LO <= HI")
    if args.label_delay >= args.horizon:
        p.error(f"--label-delay ({args.label_delay}) must be shorter than --horizon ({args.horizon})")
    args.learners = ",".join(dict.fromkeys(x.strip() for x in args.learners.split(",") if x.strip()))
    unknown = [x for x in args.learners.split(",") if x not in stages.LEARNERS + ("none",)]
    if "none" in args.learners.split(","):
        unknown += [] if args.learners == "none" else ["none together with a learner"]
    if unknown or not args.learners:
        p.error(f"--learners: {', '.join(unknown) or 'none given'}; choose among {', '.join(stages.LEARNERS)} "
                "(comma-separated)")
    return args


# Defaults per setting (an option given on the command line wins). "paper": the RIFT paper's RIFT-ada setting.
PRESETS = {
    "cpu": {},
    "paper": {"input_tokens": 32768, "max_new_tokens": 4096, "budget": 8192, "draft_length": 11, "temperature": 1.0,
              "task": "low,sort", "periods": [64, 128, 256, 512, 1024, 2048, 4096]},
}


# Files of a finished run (refused or deleted as "a previous run"), and options that do not change its results.
RESULT_FILES = ("tradeoff.csv", "tradeoff.png", "tradeoff_time.png", "metrics.json", "controller.json",
                "controller.pt")
SESSION_OPTIONS = ("output_dir", "resume", "overwrite", "threads", "wandb_project", "wandb_mode", "vec_env", "workers")


def main(argv=None) -> int:
    from rift_ada import distributed

    if distributed.launched_world_size() > 1:
        # Every process would run the whole job and write the same files. Its pieces shard by themselves where they
        # can (trainers/counterfactual.collect, rift_ada.evaluate); PPO / DQN training here is one process.
        err = ValueError("experiments/train_controller.py runs as one process: run it without torchrun "
                         "(its PPO / DQN training is not data parallel)")
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
        pair, train_ids, eval_ids = stages.load(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    announce_resume(state, out, args, stages.plan(args, len(train_ids)))
    from rift_ada.speculative import SpeculativeDecoder
    from rift_ada.trainers.wandb_logging import ResumableRun

    # The W&B run's id lives in the state, so a resumed job logs to the same run.
    run = ResumableRun(state.path("wandb.json"), project=args.wandb_project, mode=args.wandb_mode, dir=str(out),
                       config=config, job_type="train_controller")
    decoding = decoding_from_args(args)
    ctx = workers.Context(pair, decoding)
    setting = workers.Setting(args.target, args.drafter, args.device, args.dtype, args.threads, decoding)
    try:
        costs = stages.costs(state, ctx.decoder(layout), train_ids[0], args.max_new_tokens)
    except ValueError as e:
        return fail(e)
    print(f"cost model: draft step {1e3 * costs.draft_step_s:.2f} ms, verify {1e3 * costs.verify_s:.2f} ms, refresh "
          f"{1e3 * costs.refresh_s:.2f} ms", file=sys.stderr)
    data, data_s = stages.collect(state, ctx, setting, layout, train_ids, args)
    labels = data.labels(args.refresh_cost if args.label_margin is None else args.label_margin, args.label)
    data_stats = {"states": int(len(labels)), "positive_rate": float(labels.mean()) if len(labels) else 0.0,
                  "mean_gain": float(data.gain.mean()) if len(labels) else 0.0}
    print(f"counterfactual data: {len(labels)} states, {data_stats['positive_rate']:.1%} labelled 'refresh' "
          f"(--label {args.label}, {data_s:.0f} s)", file=sys.stderr)
    fitted = stages.fit(state, run, data, labels, data_stats, args)
    learned, learn_s = stages.learn(state, run, args, pair, layout, decoding, train_ids, costs)
    points = stages.sweep_points(args, data.X, fitted, learned)
    results = stages.run_sweep(state, points, ctx, setting, layout, eval_ids, args)
    timings = {"counterfactual_s": data_s, "learners_s": learn_s, "sweep_s": sum(r["seconds"] for r in results)}
    finish(out, state, run, args, points, results, timings, data_stats, costs, t_start)
    return 0


def announce_resume(state, out: Path, args, plan: list[list[str]]) -> None:
    done = [sum(state.has(n) for n in names) for names in plan]
    if any(done):
        print(f"resuming {out}: {done[0]}/{len(plan[0])} counterfactual prompts, {done[1]}/{len(plan[1])} "
              f"{'/'.join(ln.upper() for ln in stages.learners_of(args)) or 'learner'} runs, {done[2]}/{len(plan[2])} sweep "
              "points already done", file=sys.stderr)


def finish(out: Path, state, run, args, points, results, timings, data_stats, costs, t_start: float) -> None:
    """Matched comparisons against periodic refresh, the export of the best learned controller, and the report."""
    from rift_ada.sweep import modelled_speed, tradeoff_row
    from rift_ada.tradeoff import matched_comparison

    full = results[0]["acceptance_length"]  # the full cache's point comes first
    # Modelled tokens/s: a function of the stored counts and the cost model (the full cache's point is left out: its
    # draft steps run on the whole prompt, not on the measured compressed cache).
    t = report.Tradeoff(full, [tradeoff_row(p, r, full) for p, r in zip(points[1:], results[1:])],
                        [modelled_speed(r, costs) for r in results[1:]], {})
    t.summary = matched_comparison(t.rows)  # adds refresh_savings / al_gain to the compared rows
    best = report.best_learned(t, ("logistic", "tree", *stages.learners_of(args)))
    ctrl = next(p.controller for p in points if p.family == best["family"] and p.knob == best["knob"])
    ctrl_path = out / f"controller{ctrl.suffix}"
    ctrl.save(ctrl_path)
    timings["session_s"] = time.time() - t_start  # this session's wall time
    extra = {"timings": timings, "controller": str(ctrl_path), "best": {k: best[k] for k in ("family", "knob")},
             "counterfactual": data_stats}
    report.log_to_wandb(run, out, t, report.write_outputs(out, t, args, extra, costs), costs)
    run.summary.update({"session_seconds": timings["session_s"]})
    run.finish()
    write_json(state.path("done.json"), {"tradeoff": str(out / "tradeoff.csv")})
    report.print_summary(t, args, best, ctrl_path, timings["session_s"])


if __name__ == "__main__":  # SB3's SubprocVecEnv (if a user switches to it) uses forkserver: keep this guard
    sys.exit(main())
