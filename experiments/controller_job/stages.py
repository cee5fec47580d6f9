"""The main job's stages. Every unit is deterministic given its inputs (greedy decoding; seeded decoders, PPO and
the logistic fit) and returns what its state file holds, so resumed and uninterrupted runs go on with identical
values."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
from tqdm.auto import tqdm

from rift_ada import signals, sweep
from rift_ada.sweep import Point

LEARNERS = ("ppo", "dqn")  # stable-baselines3 learners, each trained once per lambda


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
    learners = [f"{ln}-lam{x:g}" for ln in args.learners.split(",") for x in args.lams]
    points = ([sweep.full_point().unit] + sweep.rule_units(args)
              + [sweep.unit_name("logistic", x) for x in args.logistic_thresholds]
              + [sweep.unit_name(ln, lam) for ln in args.learners.split(",") for lam in args.lams]
              + [p.unit for p in sweep.oracle_points(args.oracle_lams)])
    return [[f"counterfactual-{i:03d}" for i in range(train_prompts)], learners, points]


def costs(state, decoder, prompt, max_new_tokens: int):
    """The cost model, measured once (a unit: a resumed run models time with the same costs)."""
    from rift_ada.costs import CostModel, measure_costs

    return CostModel.from_dict(state.unit("costs", lambda: measure_costs(
        decoder, prompt, max(128, max_new_tokens)).to_dict()))


def collect(state, decoder, prompts, args):
    """Counterfactual data, one unit per prompt: (CounterfactualData, seconds spent on it over all sessions)."""
    from rift_ada.trainers import counterfactual

    periods = counterfactual.behaviour_periods(len(prompts), seed=args.seed)

    def prompt_unit(i):
        X, gain = counterfactual.collect_prompt(decoder, prompts[i], args.max_new_tokens, periods[i], args.horizon,
                                                args.label_every)
        return {"X": X.tolist(), "gain": gain.tolist()}

    parts = [state.unit(f"counterfactual-{i:03d}", lambda i=i: prompt_unit(i))
             for i in tqdm(range(len(prompts)), desc="counterfactual data")]
    data = counterfactual.CounterfactualData(
        np.asarray([x for p in parts for x in p["X"]], dtype=np.float32).reshape(-1, len(signals.NAMES)),
        np.asarray([g for p in parts for g in p["gain"]], dtype=np.float64), args.horizon)
    return data, sum(p["seconds"] for p in parts)


def fit(state, run, data, labels, stats: dict, seed: int):
    """The logistic controller fitted on the labels (one unit), or None when they hold a single class."""
    from rift_ada.controllers import fit_logistic
    from rift_ada.refresh import LogisticController

    def logistic_unit():
        run.log({f"data/{k}": v for k, v in stats.items()})
        if len(np.unique(labels)) < 2:
            return {"weights": None}
        model = fit_logistic(data.X, labels, seed=seed)
        accuracy = float(((model.sklearn_model.predict_proba(data.X)[:, 1] > 0.5) == labels).mean())
        run.log({"logistic/train_accuracy": accuracy})
        return {"weights": model.weights.tolist(), "bias": model.bias, "train_accuracy": accuracy}

    stored = state.unit("logistic", logistic_unit)
    if stored["weights"] is None:
        print("warning: every counterfactual label is the same; skipping the logistic controller (collect more "
              "states with --train-prompts / --label-every, or change --label-margin)", file=sys.stderr)
        return None
    return LogisticController(np.asarray(stored["weights"]), stored["bias"])


def learn(state, run, args, pair, layout, decoding, prompts, cost_model) -> tuple[dict, float]:
    """One PPO / DQN run per learner and lambda (a unit each, its export beside it): ({(learner, lambda): controller},
    seconds spent on them over all sessions)."""
    from rift_ada.refresh.registry import KINDS

    learned, seconds = {}, 0.0
    for learner in args.learners.split(","):
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


def sweep_points(args, observed, logistic, learned: dict) -> list[Point]:
    """The main job's tradeoff points: the full cache, every swept kind (``rift_ada.sweep.rule_points``; a knob of
    quantiles takes its levels in the ``observed`` counterfactual states), the logistic controller at each decision
    threshold (unless none was fitted), each learner at each lambda, the oracle at each price."""
    from rift_ada.refresh import LogisticController

    for kind in sweep.unobserved(observed):
        print(f"warning: no counterfactual states to take quantiles from; skipping the {kind} rule", file=sys.stderr)
    points = [sweep.full_point()] + sweep.rule_points(args, observed)
    if logistic is not None:
        points += [Point("logistic", x, LogisticController(logistic.weights, logistic.bias, x),
                         sweep.unit_name("logistic", x)) for x in args.logistic_thresholds]
    points += [Point(ln, lam, learned[ln, lam], sweep.unit_name(ln, lam)) for ln, lam in learned]
    return points + sweep.oracle_points(args.oracle_lams)


def run_sweep(state, points: list[Point], decoder, full_decoder, prompts, args) -> list[dict]:
    """One unit per point on the held-out prompts: its counts (``rift_ada.sweep.measure``)."""
    return [state.unit(p.unit, lambda p=p: sweep.measure(p, full_decoder if p.family == "full" else decoder, prompts,
                                                         args.max_new_tokens, args.oracle_block, args.oracle_beam))
            for p in tqdm(points, desc="tradeoff sweep")]

