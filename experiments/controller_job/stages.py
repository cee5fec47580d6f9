"""The main job's stages. Every unit is deterministic given its inputs (greedy decoding; seeded decoders, PPO and
the logistic fit) and returns what its state file holds, so resumed and uninterrupted runs go on with identical
values."""

from __future__ import annotations

import random
import sys
from dataclasses import replace

import numpy as np
from tqdm.auto import tqdm

from rift_ada import signals, sweep
from rift_ada.sweep import Point

LEARNERS = ("ppo", "dqn")  # stable-baselines3 learners, each trained once per lambda


# Signals the tree may not split on: the position in the generation says which training prompt a state came from
# more than anything about the cache (with a few prompts, a depth-3 tree split on it and refreshed a held-out high
# prompt 105 times per 1K tokens).
TREE_IGNORES = ("position",)


def learners_of(args) -> list[str]:
    """The SB3 learners of ``--learners`` (none: the logistic controller alone)."""
    return [] if args.learners == "none" else args.learners.split(",")


def load(args):
    """The pair and the encoded training and held-out prompts (a mix of the --task families)."""
    from rift_ada.data import build_task_mix, encode_prompts, task_mix
    from rift_ada.models import load_pair
    from rift_ada.testbed.check import check_fits

    pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype, device_map=args.device_map)
    for model in (pair.target, pair.draft):  # before building prompts (32K-token ones take a while)
        check_fits(model, args.input_tokens + args.max_new_tokens, "--input-tokens + --max-new-tokens")
    bar = tqdm(total=2 * len(task_mix(args.task)), desc="building prompts")
    train = build_task_mix(pair.tokenizer, args.task, args.train_prompts, args.input_tokens, args.seed + 1, "train",
                           bar)
    held_out = build_task_mix(pair.tokenizer, args.task, args.eval_prompts, args.input_tokens, args.seed, "eval", bar)
    bar.close()
    return pair, encode_prompts(pair.tokenizer, train), encode_prompts(pair.tokenizer, held_out)


def plan(args, train_prompts: int) -> list[list[str]]:
    """The units of each stage that resumes in pieces: counterfactual prompts, learner runs, sweep points."""
    learners = [f"{ln}-lam{x:g}" for ln in learners_of(args) for x in args.lams]
    points = ([sweep.full_point().unit] + sweep.rule_units(args)
              + [sweep.unit_name("logistic", x) for x in args.logistic_thresholds]
              + [sweep.unit_name("tree", x) for x in args.tree_decisions]
              + [sweep.unit_name(ln, lam) for ln in learners_of(args) for lam in args.lams]
              + [p.unit for p in sweep.oracle_points(args.oracle_lams)])
    return [[f"counterfactual-{i:03d}" for i in range(train_prompts)], learners, points]


def costs(state, decoder, prompt, max_new_tokens: int):
    """The cost model, measured once (a unit: a resumed run models time with the same costs)."""
    from rift_ada.costs import CostModel, measure_costs

    return CostModel.from_dict(state.unit("costs", lambda: measure_costs(
        decoder, prompt, min(256, max_new_tokens)).to_dict()))  # medians per round: 256 tokens suffice


def counterfactual_unit(ctx, layout, ids, max_new_tokens, period_range, seed, horizon, every, per_prompt, delay,
                        branch_temperature) -> dict:
    """One training prompt's counterfactual data (a unit; ``ctx``: a ``workers.Context``)."""
    from rift_ada.trainers import counterfactual

    X, gain, wait = counterfactual.collect_prompt(ctx.decoder(layout), ids, max_new_tokens, tuple(period_range),
                                                  horizon, every, per_prompt, delay, branch_temperature, seed)
    return {"X": X.tolist(), "gain": gain.tolist(), "wait": wait.tolist()}


def collect(state, ctx, setting, layout, prompts, args):
    """Counterfactual data, one unit per prompt: (CounterfactualData, seconds spent on it over all sessions). Each prompt's trajectory refreshes after periods drawn from --behaviour-periods (a new one
    after every refresh), so every task family contributes fresh, expiring and stale states."""
    from rift_ada.trainers import counterfactual

    from .workers import run_units

    rng = random.Random(args.seed)
    seeds = [rng.randrange(2**31) for _ in prompts]  # each prompt's behaviour schedule, drawn up front
    branch_t = None if args.label_temperature < 0 else args.label_temperature
    units = [(f"counterfactual-{i:03d}", counterfactual_unit,
              (layout, prompts[i], args.max_new_tokens, tuple(args.behaviour_periods), seeds[i], args.horizon,
               args.label_every,
               args.states_per_prompt, args.label_delay, branch_t)) for i in range(len(prompts))]
    parts = run_units(state, units, ctx, setting, args.workers, "counterfactual data")
    data = counterfactual.CounterfactualData(
        np.asarray([x for p in parts for x in p["X"]], dtype=np.float32).reshape(-1, len(signals.NAMES)),
        np.asarray([g for p in parts for g in p["gain"]], dtype=np.float64), args.horizon,
        np.asarray([g for p in parts for g in p["wait"]], dtype=np.float64))
    return data, sum(p["seconds"] for p in parts)


def fit(state, run, data, labels, stats: dict, args):
    """The controllers fitted on the labels: {"logistic": ..., "tree": ...}, each a unit (None when the labels hold a
    single class). The logistic fit's learning curve (held-out log-loss and accuracy against training states) goes
    to W&B and its unit."""
    from rift_ada.controllers import fit_logistic, fit_tree, learning_curve
    from rift_ada.refresh import LogisticController, TreeController

    one_class = len(np.unique(labels)) < 2

    def logistic_unit():
        run.log({f"data/{k}": v for k, v in stats.items()})
        if one_class:
            return {"weights": None}
        curve = learning_curve(data.X, labels, seed=args.seed)
        run.define_metric("logistic/curve/*", step_metric="logistic/curve/train_states")
        for point in curve:
            run.log({f"logistic/curve/{k}": v for k, v in point.items()})
        model = fit_logistic(data.X, labels, seed=args.seed)
        accuracy = float(((model.sklearn_model.predict_proba(data.X)[:, 1] > 0.5) == labels).mean())
        run.log({"logistic/train_accuracy": accuracy})
        return {"weights": model.weights.tolist(), "bias": model.bias, "train_accuracy": accuracy,
                "learning_curve": curve}

    def tree_unit():
        if one_class:
            return {"tree": None}
        curve = learning_curve(data.X, labels, seed=args.seed, fit=lambda X, y, seed: fit_tree(
            X, y, max_depth=args.tree_depth, seed=seed, ignore=TREE_IGNORES))
        run.define_metric("tree/curve/*", step_metric="tree/curve/train_states")
        for point in curve:
            run.log({f"tree/curve/{k}": v for k, v in point.items()})
        tree = fit_tree(data.X, labels, max_depth=args.tree_depth, seed=args.seed, ignore=TREE_IGNORES)
        accuracy = float((tree.sklearn_model.predict(data.X) == labels).mean())
        run.log({"tree/train_accuracy": accuracy, "tree/leaves": int(sum(c == -1 for c in tree.left))})
        return {"tree": {k: list(getattr(tree, k)) for k in ("feature", "threshold", "left", "right", "value")},
                "train_accuracy": accuracy, "rules": tree.describe(), "learning_curve": curve}

    fitted = {}
    stored = state.unit("logistic", logistic_unit)
    fitted["logistic"] = None if stored["weights"] is None else LogisticController(np.asarray(stored["weights"]),
                                                                                   stored["bias"])
    stored = state.unit("tree", tree_unit)
    fitted["tree"] = None if stored["tree"] is None else TreeController(**{k: tuple(v) for k, v in
                                                                           stored["tree"].items()})
    if one_class:
        print("warning: every counterfactual label is the same; skipping the logistic and tree controllers (collect "
              "more states with --train-prompts / --label-every, or change --label-margin)", file=sys.stderr)
    return fitted


def learn(state, run, args, pair, layout, decoding, prompts, cost_model) -> tuple[dict, float]:
    """One PPO / DQN run per learner and lambda (a unit each, its export beside it): ({(learner, lambda): controller},
    seconds spent on them over all sessions)."""
    from rift_ada.refresh.registry import KINDS

    learned, seconds = {}, 0.0
    for learner in learners_of(args):
        for lam in args.lams:
            name = f"{learner}-lam{lam:g}"
            unit = state.unit(name, lambda lr=learner, lam=lam, name=name: _train(
                state, run, args, lr, lam, name, pair, layout, decoding, prompts, cost_model))
            seconds += unit["seconds"]
            learned[learner, lam] = KINDS[learner].load(state.path(f"{name}.pt"))  # the same weights, resumed or not
    return learned, seconds


def _train(state, run, args, learner, lam, name, pair, layout, decoding, prompts, cost_model) -> dict:
    from rift_ada.envs import RefreshEnv
    from rift_ada.envs.vec import RefreshEnvSpec
    from rift_ada.speculative import SpeculativeDecoder
    from rift_ada.trainers.dqn import export_dqn, train_dqn
    from rift_ada.trainers.ppo import export_ppo, train_ppo
    from rift_ada.trainers.resume import atomic_write
    from rift_ada.trainers.wandb_logging import sb3_logger

    env = dict(lam=lam, refresh_cost=args.refresh_cost, reward=args.reward, costs=cost_model)
    if args.vec_env == "subproc":  # each worker loads the pair itself: a spec, not a closure over the models
        env_fns = [RefreshEnvSpec(tuple(map(tuple, prompts)), layout, args.target, args.drafter, args.device,
                                  args.dtype, decoding.draft_length, decoding.temperature, decoding.top_p, seed=i,
                                  max_new_tokens=args.max_new_tokens, threads=args.threads, **env)
                   for i in range(args.n_envs)]
    else:  # one decoder per env; all share the loaded models
        env_fns = [lambda i=i: RefreshEnv(SpeculativeDecoder.for_pair(pair, layout, replace(decoding, seed=i)),
                                          prompts, args.max_new_tokens, **env)
                   for i in range(args.n_envs)]
    prefix = f"{learner}_lam{lam:g}"
    run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/timesteps")
    fit_fn, export_fn, timesteps = {"ppo": (train_ppo, export_ppo, args.ppo_timesteps),
                                    "dqn": (train_dqn, export_dqn, args.dqn_timesteps)}[learner]
    model, venv = fit_fn(env_fns, timesteps, seed=args.seed, logger=sb3_logger(run.log, prefix),
                         progress=f"{learner.upper()} lambda={lam:g}", subproc=args.vec_env == "subproc")
    venv.close()
    atomic_write(state.path(f"{name}.pt"), export_fn(model, venv, lam).save)  # before the unit's JSON
    return {"lam": lam}


def sweep_points(args, observed, fitted: dict, learned: dict) -> list[Point]:
    """The main job's tradeoff points: the full cache, every swept kind (``rift_ada.sweep.rule_points``; a knob of
    quantiles takes its levels in the ``observed`` counterfactual states), the logistic controller at each decision
    threshold and the tree at each decision level (unless none was fitted), each learner at each lambda, the oracle
    at each price."""
    from dataclasses import replace as with_knob

    for kind in sweep.unobserved(observed):
        print(f"warning: no counterfactual states to take quantiles from; skipping the {kind} rule", file=sys.stderr)
    points = [sweep.full_point()] + sweep.rule_points(args, observed)
    for family, knobs, field in (("logistic", args.logistic_thresholds, "threshold"),
                                 ("tree", args.tree_decisions, "decision")):
        if fitted.get(family) is not None:
            points += [Point(family, x, with_knob(fitted[family], **{field: x}), sweep.unit_name(family, x))
                       for x in knobs]
    points += [Point(ln, lam, learned[ln, lam], sweep.unit_name(ln, lam)) for ln, lam in learned]
    return points + sweep.oracle_points(args.oracle_lams)


def sweep_unit(ctx, point, layout, prompts, max_new_tokens, block, beam, seeds) -> dict:
    """One tradeoff point's counts on the held-out prompts (a unit; ``rift_ada.sweep.measure``)."""
    from rift_ada.layout import CacheLayout

    decoder = ctx.decoder(CacheLayout("full") if point.family == "full" else layout)
    return sweep.measure(point, decoder, prompts, max_new_tokens, block, beam, seeds)


def run_sweep(state, points: list[Point], ctx, setting, layout, prompts, args) -> list[dict]:
    """One unit per point on the held-out prompts: its counts (``rift_ada.sweep.measure``), over --eval-seeds."""
    from .workers import run_units

    units = [(p.unit, sweep_unit, (p, layout, prompts, args.max_new_tokens, args.oracle_block, args.oracle_beam,
                                   args.eval_seeds)) for p in points]
    return run_units(state, units, ctx, setting, args.workers, "tradeoff sweep",
                     first=[p.unit for p in points if p.family == "oracle"])
