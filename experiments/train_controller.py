"""Learn when to refresh the draft's RIFT cache, and compare every controller family on a tradeoff curve.

    python experiments/train_controller.py                  # built-in testbed, under 20 minutes on 2 CPU cores
    python experiments/train_controller.py --resume         # after an interruption: continue where it stopped

1. Counterfactual data on training prompts: at many decoder states, fork, refresh in one branch only, and compare
   the accepted tokens of the next rounds.
2. A logistic controller fitted on those labels; per refresh-cost weight lambda, a controller of each SB3 learner in
   --learners (PPO, DQN) trained in RefreshEnv with --reward tokens (accepted drafts - lambda x refresh cost) or time
   (modelled tokens per second: round times from a cost model measured once at the start, rift_ada.costs).
3. Every family swept across its knob on held-out prompts (periodic: period; threshold: acceptance level; entropy:
   draft-entropy level, at quantiles of the entropies in the counterfactual data; logistic: decision threshold;
   PPO, DQN: lambda), giving acceptance length (AL) and modelled tokens per second versus refreshes per 1K tokens.
4. Output folder: tradeoff.csv, tradeoff.png (AL vs refreshes), tradeoff_time.png (modelled tokens/s vs refreshes),
   metrics.json (with the cost model and each point's modelled tokens/s), the best learned controller exported
   (controller.json or controller.pt, loadable without scikit-learn or stable-baselines3), and a W&B run (offline by
   default: ``wandb sync <output-dir>/wandb/offline-run-*`` uploads it later).
5. Prints, per learned family, the % fewer refreshes than periodic refresh at matched AL and the AL gain at a matched
   refresh count.

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
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from rift_ada import signals
from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_model_options,
                          add_runtime_options, apply_runtime, fail, policy_from_args, require_positive)
from rift_ada.refresh import (EntropyController, LogisticController, NeverController, PeriodicController,
                              ThresholdController)
from rift_ada.tradeoff import matched_comparison
from rift_ada.trainers.resume import atomic_write, config_of, open_state, write_json


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed", device_map=True)  # an external draft, as in the paper's RIFT-ada setting
    add_cache_options(p, policy=None)  # a RIFT layout; the controllers are what is learned
    add_decoding_options(p)
    add_runtime_options(p)
    m = p.add_argument_group("task")
    m.add_argument("--task", default="low,high",
                   help="task family: low, mixed, high, or a comma-separated mix (e.g. low,high: the controller must "
                        "learn where a refresh pays off)")
    m.add_argument("--input-tokens", type=int, default=2048)
    m.add_argument("--train-prompts", type=int, default=4, help="prompts for counterfactual data and PPO")
    m.add_argument("--eval-prompts", type=int, default=3, help="held-out prompts for the tradeoff curves")
    t = p.add_argument_group("training")
    t.add_argument("--horizon", type=int, default=8, help="rounds per counterfactual branch")
    t.add_argument("--label-every", type=int, default=2, help="label every n-th round of the data trajectories")
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
    t.add_argument("--ppo-timesteps", type=int, default=1024,
                   help="PPO environment steps (rounds) per lambda, rounded up to whole rollouts (128 x --n-envs)")
    t.add_argument("--learners", default="ppo",
                   help="comma-separated stable-baselines3 learners to train per lambda: ppo, dqn (e.g. ppo,dqn)")
    t.add_argument("--dqn-timesteps", type=int, default=2000,
                   help="DQN environment steps (rounds) per lambda, rounded up to a multiple of --n-envs")
    t.add_argument("--lams", type=float, nargs="+", default=[4.0],
                   help="refresh-cost weights for the learners (their knob on the tradeoff curve)")
    t.add_argument("--n-envs", type=int, default=2, help="RefreshEnvs stepping together for PPO / DQN")
    t.add_argument("--vec-env", default="dummy", choices=["dummy", "subproc"],
                   help="dummy: the envs step in this process, sharing its models; subproc: one worker process per env, "
                        "each loading its own models (experiments/bench_env.py measures both)")
    k = p.add_argument_group("tradeoff sweep")
    k.add_argument("--periods", type=int, nargs="+", default=[16, 32, 64, 128])
    k.add_argument("--acc-thresholds", type=float, nargs="+", default=[0.5, 0.85])
    k.add_argument("--entropy-quantiles", type=float, nargs="+", default=[0.9],
                   help="entropy rule: refresh when the last round's mean draft entropy exceeds these quantiles of "
                        "the entropies in the counterfactual data (the knob reported is the entropy level)")
    k.add_argument("--logistic-thresholds", type=float, nargs="+", default=[0.7])
    k.add_argument("--oracle-lams", type=float, nargs="*", default=[1.0, 4.0],
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
    require_positive(p, args, ("budget", "max_new_tokens", "train_prompts", "eval_prompts", "horizon",
                               "ppo_timesteps", "dqn_timesteps", "draft_length", "label_every", "threads", "n_envs",
                               "oracle_beam", "oracle_block"))
    if (any(x <= 0 for x in args.periods) or any(x < 0 for x in args.lams + args.oracle_lams)
            or args.refresh_cost < 0):
        p.error("periods must be > 0; lambdas and the refresh cost >= 0")
    if any(not 0 < x < 1 for x in args.acc_thresholds + args.logistic_thresholds + args.entropy_quantiles):
        p.error("thresholds and entropy quantiles must lie in (0, 1)")
    args.learners = ",".join(dict.fromkeys(x.strip() for x in args.learners.split(",") if x.strip()))
    unknown = [x for x in args.learners.split(",") if x not in LEARNERS]
    if unknown or not args.learners:
        p.error(f"--learners: {', '.join(unknown) or 'none given'}; choose among {', '.join(LEARNERS)} "
                "(comma-separated)")
    return args


LEARNERS = ("ppo", "dqn")  # stable-baselines3 learners, each trained once per lambda

# Defaults per setting (an option given on the command line wins). "paper": the RIFT paper's RIFT-ada setting.
PRESETS = {
    "cpu": {},
    "paper": {"input_tokens": 32768, "max_new_tokens": 4096, "budget": 8192, "draft_length": 11, "temperature": 1.0,
              "task": "low,sort", "periods": [64, 128, 256, 512, 1024, 2048, 4096]},
}


# Files of a finished run (refused or deleted as "a previous run"), and options that do not change its results.
RESULT_FILES = ("tradeoff.csv", "tradeoff.png", "tradeoff_time.png", "metrics.json", "controller.json",
                "controller.pt")
SESSION_OPTIONS = ("output_dir", "resume", "overwrite", "threads", "wandb_project", "wandb_mode", "vec_env")


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

    from rift_ada.controllers import fit_logistic
    from rift_ada.costs import CostModel, measure_costs
    from rift_ada.data import encode_prompts
    from rift_ada.envs import RefreshEnv
    from rift_ada.envs.vec import RefreshEnvSpec
    from rift_ada.oracle import oracle_schedule
    from rift_ada.evaluate import evaluate
    from rift_ada.layout import CacheLayout
    from rift_ada.models import load_pair
    from rift_ada.refresh.registry import KINDS as MLP_KINDS
    from rift_ada.speculative import SpeculativeDecoder
    from rift_ada.testbed.check import check_fits
    from rift_ada.trainers import counterfactual
    from rift_ada.trainers.dqn import export_dqn, train_dqn
    from rift_ada.trainers.ppo import export_ppo, train_ppo
    from rift_ada.trainers.wandb_logging import ResumableRun, sb3_logger

    try:
        pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype,
                         device_map=args.device_map)
        for model in (pair.target, pair.draft):  # before building prompts (32K-token ones take a while)
            check_fits(model, args.input_tokens + args.max_new_tokens, "--input-tokens + --max-new-tokens")
        enc = lambda tasks: encode_prompts(pair.tokenizer, tasks)  # noqa: E731
        bar = tqdm(total=2 * len(families(args.task)), desc="building prompts")
        train_tasks = mixed_tasks(pair.tokenizer, args.task, args.train_prompts, args.input_tokens, args.seed + 1,
                                  "train", bar)
        eval_tasks = mixed_tasks(pair.tokenizer, args.task, args.eval_prompts, args.input_tokens, args.seed, "eval",
                                 bar)
        bar.close()
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    train_ids, eval_ids = enc(train_tasks), enc(eval_tasks)
    draft = None if pair.self_speculative else pair.draft
    def make_decoder(lay=layout, seed=args.seed):  # one decoder per env or sweep; all share the loaded models
        return SpeculativeDecoder(pair.target, draft, lay, args.draft_length, temperature=args.temperature,
                                  top_p=args.top_p, eos_token_id=pair.tokenizer.eos_token_id, seed=seed)
    sweep = sweep_units(args)
    learners = args.learners.split(",")
    trained = [f"{ln}-lam{x:g}" for ln in learners for x in args.lams]
    done = [sum(state.has(n) for n in names) for names in (
        [f"counterfactual-{i:03d}" for i in range(len(train_ids))], trained, [name for name, *_ in sweep])]
    if any(done):
        print(f"resuming {out}: {done[0]}/{len(train_ids)} counterfactual prompts, {done[1]}/{len(trained)} "
              f"{'/'.join(ln.upper() for ln in learners)} runs, {done[2]}/{len(sweep)} sweep points already done",
              file=sys.stderr)
    # The W&B run's id lives in the state, so a resumed job logs to the same run.
    run = ResumableRun(state.path("wandb.json"), project=args.wandb_project, mode=args.wandb_mode, dir=str(out),
                       config=config, job_type="train_controller")

    # Every unit below is deterministic given its inputs (greedy decoding; seeded decoders, PPO and logistic fit) and
    # returns what its state file holds, so resumed and uninterrupted runs continue with identical values.
    # 0. The cost model, measured once (a unit: a resumed run models time with the same costs) ------------------
    try:
        costs = CostModel.from_dict(state.unit("costs", lambda: measure_costs(
            make_decoder(), train_ids[0], max(128, args.max_new_tokens)).to_dict()))
    except ValueError as e:
        return fail(e)
    print(f"cost model: draft step {1e3 * costs.draft_step_s:.2f} ms, verify {1e3 * costs.verify_s:.2f} ms, refresh "
          f"{1e3 * costs.refresh_s:.2f} ms", file=sys.stderr)

    # 1. Counterfactual data, one unit per prompt ----------------------------------------------------------------
    periods = counterfactual.behaviour_periods(len(train_ids), seed=args.seed)
    dec = make_decoder()

    def collect(i):
        X, gain = counterfactual.collect_prompt(dec, train_ids[i], args.max_new_tokens, periods[i], args.horizon,
                                                args.label_every)
        return {"X": X.tolist(), "gain": gain.tolist()}

    parts = [state.unit(f"counterfactual-{i:03d}", lambda i=i: collect(i))
             for i in tqdm(range(len(train_ids)), desc="counterfactual data")]
    data = counterfactual.CounterfactualData(
        np.asarray([x for p in parts for x in p["X"]], dtype=np.float32).reshape(-1, len(signals.NAMES)),
        np.asarray([g for p in parts for g in p["gain"]], dtype=np.float64), args.horizon)
    labels = data.labels(margin=args.refresh_cost if args.label_margin is None else args.label_margin)
    data_stats = {"states": int(len(labels)), "positive_rate": float(labels.mean()) if len(labels) else 0.0,
                  "mean_gain": float(data.gain.mean()) if len(labels) else 0.0}
    print(f"counterfactual data: {len(labels)} states, {data_stats['positive_rate']:.1%} where refreshing paid off "
          f"({sum(p['seconds'] for p in parts):.0f} s)", file=sys.stderr)

    # 2. Logistic (one unit), PPO / DQN (one unit per learner and lambda) ----------------------------------------------
    def logistic_unit():
        run.log({f"data/{k}": v for k, v in data_stats.items()})
        if len(np.unique(labels)) < 2:
            return {"weights": None}
        fit = fit_logistic(data.X, labels, seed=args.seed)
        accuracy = float(((fit.sklearn_model.predict_proba(data.X)[:, 1] > 0.5) == labels).mean())
        run.log({"logistic/train_accuracy": accuracy})
        return {"weights": fit.weights.tolist(), "bias": fit.bias, "train_accuracy": accuracy}

    fit = state.unit("logistic", logistic_unit)
    if fit["weights"] is None:
        print("warning: every counterfactual label is the same; skipping the logistic controller (collect more "
              "states with --train-prompts / --label-every, or change --label-margin)", file=sys.stderr)

    train = {"ppo": (train_ppo, export_ppo, args.ppo_timesteps), "dqn": (train_dqn, export_dqn, args.dqn_timesteps)}

    def learn(learner, lam, name):
        if args.vec_env == "subproc":  # each worker loads the pair itself: a spec, not a closure over the models
            env_fns = [RefreshEnvSpec(tuple(map(tuple, train_ids)), layout, args.target, args.drafter, args.device,
                                      args.dtype, args.draft_length, args.temperature, args.top_p, seed=i,
                                      max_new_tokens=args.max_new_tokens, lam=lam, refresh_cost=args.refresh_cost,
                                      reward=args.reward, costs=costs, threads=args.threads)
                       for i in range(args.n_envs)]
        else:
            env_fns = [lambda i=i: RefreshEnv(make_decoder(seed=i), train_ids, args.max_new_tokens, lam=lam,
                                              refresh_cost=args.refresh_cost, reward=args.reward, costs=costs)
                       for i in range(args.n_envs)]
        prefix = f"{learner}_lam{lam:g}"
        run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/timesteps")
        fit_fn, export_fn, timesteps = train[learner]
        model, venv = fit_fn(env_fns, timesteps, seed=args.seed, logger=sb3_logger(run.log, prefix),
                             progress=f"{learner.upper()} lambda={lam:g}", subproc=args.vec_env == "subproc")
        venv.close()
        atomic_write(state.path(f"{name}.pt"), export_fn(model, venv, lam).save)  # before the unit's JSON
        return {"lam": lam}

    learner_units, learned = [], {}
    for learner in learners:
        for lam in args.lams:
            name = f"{learner}-lam{lam:g}"
            learner_units.append(state.unit(name, lambda lr=learner, lam=lam, name=name: learn(lr, lam, name)))
            # the same weights whether resumed or not
            learned[learner, lam] = MLP_KINDS[learner].load(state.path(f"{name}.pt"))

    # 3. Tradeoff sweep on held-out prompts, one unit per point --------------------------------------------------------
    dec = make_decoder()

    def sweep_point(family, ctrl):
        if family == "oracle":  # ctrl is the refresh price lambda
            return oracle_point(ctrl)
        ev = evaluate(make_decoder(CacheLayout("full")) if family == "full" else dec, eval_ids, ctrl,
                      args.max_new_tokens)
        res = ev.summary
        # What the modelled time needs, not the time itself: the stored point stays independent of the costs.
        return {"acceptance_length": res["acceptance_length"], "refreshes_per_1k": res["refreshes_per_1k_tokens"],
                "refreshes": res["refreshes"], "tokens": res["generated_tokens"],
                "rounds": sum(len(r.rounds) for r in ev.results),
                "drafted": sum(x.draft_length for r in ev.results for x in r.rounds)}

    def oracle_point(lam):
        res = [oracle_schedule(dec, ids, args.max_new_tokens, lam, args.oracle_block, args.oracle_beam)
               for ids in tqdm(eval_ids, desc=f"oracle lambda={lam:g}", leave=False)]
        tokens = sum(r.tokens for r in res)
        return {"acceptance_length": float(np.mean([r.acceptance_length for r in res])),
                "refreshes_per_1k": 1000 * sum(r.refreshes for r in res) / tokens,
                "refreshes": sum(r.refreshes for r in res), "tokens": tokens, "rounds": sum(r.rounds for r in res),
                "drafted": sum(r.drafted for r in res)}

    logistic = None if fit["weights"] is None else LogisticController(np.asarray(fit["weights"]), fit["bias"])
    entropy_levels = entropy_thresholds(data.X, args.entropy_quantiles)
    if entropy_levels is None:
        print("warning: no counterfactual states to take entropy quantiles from; skipping the entropy rule",
              file=sys.stderr)
    controllers = {"never": lambda _: NeverController(), "periodic": PeriodicController,
                   "threshold": lambda x: ThresholdController([("acc_mean", "<", x)]),
                   "entropy": EntropyController,
                   "logistic": lambda x: LogisticController(logistic.weights, logistic.bias, x),
                   "ppo": lambda lam: learned["ppo", lam], "dqn": lambda lam: learned["dqn", lam],
                   "oracle": lambda lam: lam, "full": lambda _: None}
    points = []
    for name, family, knob in sweep:
        if family == "entropy":  # the unit is named by its quantile; the knob is the entropy level it gives
            if entropy_levels is None:
                continue
            knob = entropy_levels[knob]
        if family != "logistic" or logistic is not None:
            points.append((name, family, knob, controllers[family](knob)))
    results = [state.unit(name, lambda family=family, ctrl=ctrl: sweep_point(family, ctrl))
               for name, family, knob, ctrl in tqdm(points, desc="tradeoff sweep")]
    full = results[0]  # the full cache's point comes first
    rows = [{"family": family, "knob": knob, "acceptance_length": r["acceptance_length"],
             "refreshes_per_1k": r["refreshes_per_1k"], "refreshes": r["refreshes"],
             "al_vs_full": r["acceptance_length"] / full["acceptance_length"]}
            for (_, family, knob, _), r in zip(points[1:], results[1:])]
    # Modelled tokens/s: a function of the stored counts and the cost model (the full cache's point is left out: its
    # draft steps run on the whole prompt, not on the measured compressed cache).
    speeds = [r["tokens"] / costs.total_seconds(r["drafted"], r["rounds"], r["refreshes"]) for r in results[1:]]
    # Compute time per phase, summed over its units whichever session ran them.
    timings = {"counterfactual_s": sum(p["seconds"] for p in parts),
               "learners_s": sum(u["seconds"] for u in learner_units),
               "sweep_s": sum(r["seconds"] for r in results)}

    # 4. Matched comparisons against periodic refresh, the export, and the logs ---------------------------------
    summary = matched_comparison(rows)  # adds refresh_savings / al_gain to the learned rows
    best = max((r for r in rows if r["family"] in ("logistic", *learners)),  # the learned controllers
               key=lambda r: (r["refresh_savings"] if r["refresh_savings"] is not None else -1.0,
                              r["acceptance_length"]))
    best_ctrl = next(c for _, f, k, c in points if f == best["family"] and k == best["knob"])
    ctrl_path = out / ("controller.pt" if best["family"] in LEARNERS else "controller.json")
    best_ctrl.save(ctrl_path)
    timings["session_s"] = time.time() - t_start  # this session's wall time
    _write_outputs(out, rows, full, summary, timings, args, ctrl_path, best, run, data_stats, costs, speeds)
    run.summary.update({"session_seconds": timings["session_s"]})
    run.finish()
    write_json(state.path("done.json"), {"tradeoff": str(out / "tradeoff.csv")})

    print(f"\nfull-cache AL {full['acceptance_length']:.3f} | budget {args.budget} | {args.eval_prompts} held-out prompts")
    print(f"{'family':>10} {'knob':>6} {'AL':>7} {'AL/full':>8} {'ref/1K':>8} {'tok/s*':>8}")
    for r, speed in zip(rows, speeds):
        print(f"{r['family']:>10} {str(r['knob']):>6} {r['acceptance_length']:7.3f} {r['al_vs_full']:8.3f} "
              f"{r['refreshes_per_1k']:8.2f} {speed:8.1f}")
    print("* tokens per second modelled with the measured costs (tradeoff_time.png)")
    for fam, s in summary["families"].items():
        sav = "n/a" if s["refresh_savings"] is None else f"{100 * s['refresh_savings']:.1f}%"
        gain = "n/a" if s["al_gain"] is None else f"{s['al_gain']:+.3f}"
        print(f"{fam}: {sav} fewer refreshes than periodic at matched AL; AL gain at matched refresh count {gain}")
    print(f"exported {best['family']} (knob {best['knob']}) -> {ctrl_path}; this session {timings['session_s']:.0f} s")
    return 0


def sweep_units(args) -> list[tuple[str, str, object]]:
    """(unit name, family, knob) of every tradeoff point, the full cache's first (logistic ones may be skipped)."""
    knobs = [("full", "-"), ("never", "-")] + [("periodic", p) for p in args.periods]
    knobs += [("threshold", x) for x in args.acc_thresholds] + [("entropy", q) for q in args.entropy_quantiles]
    knobs += [("logistic", x) for x in args.logistic_thresholds]
    knobs += [(learner, lam) for learner in args.learners.split(",") for lam in args.lams]
    knobs += [("oracle", lam) for lam in args.oracle_lams]
    return [(f"sweep-{f}" + ("" if k == "-" else f"-q{k:g}" if f == "entropy" else f"-{k:g}"), f, k)
            for f, k in knobs]


def entropy_thresholds(X: np.ndarray, quantiles) -> dict | None:
    """quantile -> the entropy_mean level at that quantile of the observed states (4 significant digits, the knob
    written to tradeoff.csv), or None without states."""
    if len(X) == 0:
        return None
    col = X[:, signals.index("entropy_mean")].astype(np.float64)
    return {q: min(1.0, float(f"{np.quantile(col, q):.4g}")) for q in quantiles}


def families(task: str) -> list[str]:
    return list(dict.fromkeys(f.strip() for f in task.split(",") if f.strip()))


def mixed_tasks(tokenizer, task: str, n: int, input_tokens: int, seed: int, split: str, bar=None):
    """``n`` tasks cycling through the comma-separated families (low,high -> low, high, low, ...); ``bar`` (tqdm)
    advances once per family."""
    from rift_ada.data import build_tasks

    fams = [f.strip() for f in task.split(",") if f.strip()]
    per = {}
    for f in families(task):
        per[f] = build_tasks(tokenizer, f, n=-(-n // len(fams)), input_tokens=input_tokens, seed=seed, split=split)
        if bar is not None:
            bar.update()
    return [per[fams[i % len(fams)]][i // len(fams)] for i in range(n)]


def _write_outputs(out: Path, rows, full, summary, timings, args, ctrl_path, best, run, data_stats, costs,
                   speeds) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import wandb

    cols = ["family", "knob", "acceptance_length", "al_vs_full", "refreshes_per_1k", "refreshes", "refresh_savings",
            "al_gain"]

    def write_csv(path):
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            w.writerows({c: r.get(c) for c in cols} for r in rows)

    atomic_write(out / "tradeoff.csv", write_csv)  # a kill never leaves half a table
    families = list(dict.fromkeys(r["family"] for r in rows))
    # The modelled speed depends on the costs measured on this machine, so it stays out of tradeoff.csv (which a
    # resumed run reproduces bit for bit) and goes to metrics.json, the second plot and W&B.
    timed = [{**r, "modelled_tokens_per_s": v} for r, v in zip(rows, speeds)]
    title = f"draft KV budget {args.budget}, {args.input_tokens}-token prompts"

    def plot(path, y, ylabel, subtitle, full_line=None):
        fig, ax = plt.subplots(figsize=(6, 4))
        for fam in families:
            pts = sorted((r["refreshes_per_1k"], r[y]) for r in timed if r["family"] == fam)
            ax.plot(*zip(*pts), marker="o", label=fam)
        if full_line is not None:
            ax.axhline(full_line, color="grey", ls="--", label="full cache")
        ax.set_xlabel("refreshes per 1K generated tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}{subtitle}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
        plt.close(fig)

    plot(out / "tradeoff.png", "acceptance_length", "acceptance length (tokens / target step)", "",
         full["acceptance_length"])
    plot(out / "tradeoff_time.png", "modelled_tokens_per_s", "tokens / s (modelled)",
         f"\nmodelled: draft step {1e3 * costs.draft_step_s:.2f} ms, verify {1e3 * costs.verify_s:.2f} ms, "
         f"refresh {1e3 * costs.refresh_s:.2f} ms")
    metrics = {"full_cache_acceptance_length": full["acceptance_length"], "rows": timed,
               "matched": summary["families"], "timings": timings, "controller": str(ctrl_path),
               "best": {k: best[k] for k in ("family", "knob")}, "counterfactual": data_stats,
               "reward": args.reward, "costs": costs.to_dict()}
    atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1, default=str)))

    wcols = cols + ["modelled_tokens_per_s"]
    table = wandb.Table(columns=wcols,
                        data=[[str(r["knob"]) if c == "knob" else r.get(c) for c in wcols] for r in timed])
    xs = [[r["refreshes_per_1k"] for r in timed if r["family"] == f] for f in families]

    def ys(key):
        return [[r[key] for r in timed if r["family"] == f] for f in families]

    run.log({"tradeoff/table": table,
             "tradeoff/al_vs_refreshes": wandb.plot.line_series(xs=xs, ys=ys("acceptance_length"), keys=families,
                                                                title="AL vs refreshes per 1K tokens",
                                                                xname="refreshes per 1K tokens"),
             "tradeoff/tokens_per_s_vs_refreshes": wandb.plot.line_series(
                 xs=xs, ys=ys("modelled_tokens_per_s"), keys=families,
                 title="modelled tokens/s vs refreshes per 1K tokens", xname="refreshes per 1K tokens"),
             "tradeoff/al_vs_refreshes_png": wandb.Image(str(out / "tradeoff.png")),
             "tradeoff/tokens_per_s_vs_refreshes_png": wandb.Image(str(out / "tradeoff_time.png"))})
    for fam, s in summary["families"].items():
        run.summary[f"{fam}/refresh_savings_at_matched_al"] = s["refresh_savings"]
        run.summary[f"{fam}/al_gain_at_matched_refreshes"] = s["al_gain"]
    run.summary["full_cache_acceptance_length"] = full["acceptance_length"]
    run.summary.update({f"costs/{k}": v for k, v in costs.to_dict().items()})


if __name__ == "__main__":  # SB3's SubprocVecEnv (if a user switches to it) uses forkserver: keep this guard
    sys.exit(main())
