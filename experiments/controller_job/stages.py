"""The main job's stages. Every unit is deterministic given its inputs (seeded tables, replays, fits and decoders) and
returns what its state file holds, so resumed and uninterrupted runs go on with identical values."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
from tqdm.auto import tqdm

from rift_ada import sweep
from rift_ada.sweep import Point

LEARNERS = ("ppo", "dqn")  # stable-baselines3 learners, each trained once per lambda on the replay env
# Signals the tree may not split on: the position in the generation says which training prompt a state came from
# more than anything about the cache.
TREE_IGNORES = ("position",)


def learners_of(args) -> list[str]:
    """The SB3 learners of ``--learners`` (none: the tree and logistic controllers alone)."""
    return [] if args.learners == "none" else args.learners.split(",")


def load(args):
    """The pair, the training prompts (``--prompts-per-source`` from each of ``--train-sources``, the --task families
    cycling) as (code base, ids) and the held-out prompts of ``--source-dir`` (a code base never trained on)."""
    from rift_ada.data import build_task_mix, encode
    from rift_ada.data.sources import build_source_mix, source_folder
    from rift_ada.models import load_pair
    from rift_ada.testbed.check import check_fits

    pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype, device_map=args.device_map)
    for model in (pair.target, pair.draft):  # before building prompts (32K-token ones take a while)
        check_fits(model, args.input_tokens + args.max_new_tokens, "--input-tokens + --max-new-tokens")
    sources = args.train_sources.split(",")
    held_out = source_folder(args.source_dir) if args.source_dir else None
    if held_out is not None and any(source_folder(s) == held_out for s in sources):
        raise ValueError(f"--source-dir {args.source_dir} is among --train-sources: the held-out code base must be "
                         "one the controllers never train on")
    bar = tqdm(total=2, desc="building prompts")
    train = build_source_mix(pair.tokenizer, sources, args.task, args.prompts_per_source, args.input_tokens,
                             args.seed + 1)
    bar.update()
    evals = build_task_mix(pair.tokenizer, args.task, args.eval_prompts, args.input_tokens, args.seed, "eval",
                           source_dir=held_out)
    bar.update()
    bar.close()
    return pair, [(src, encode(pair.tokenizer, t.prompt)) for src, t in train], \
        [encode(pair.tokenizer, t.prompt) for t in evals]


def costs(state, decoder, prompt, max_new_tokens: int):
    """The cost model, measured once (a unit: a resumed run models time with the same costs)."""
    from rift_ada.costs import CostModel, measure_costs

    return CostModel.from_dict(state.unit("costs", lambda: measure_costs(
        decoder, prompt, min(256, max_new_tokens)).to_dict()))  # medians per round: 256 tokens suffice


def tables(out, pair, args, layout, decoding, train, evals):
    """Replay tables (``rift_ada.replay``) for the held-out prompts (one per --eval-seeds seed: the oracle's and the
    replayed points, --max-new-tokens each) and for the training prompts (``--tables-per-prompt`` sampled
    continuations each, ``--train-new-tokens`` long: the signals are local, and a table's rows cost the square of its
    length), kept in ``<output-dir>/tables`` (a resumed job reuses them). Returns (training tables, held-out tables,
    seconds spent building now)."""
    import time

    from rift_ada.replay import ReplayTable
    from rift_ada.replay.build import Builder, TableSpec, build_tables

    t0 = time.time()
    builder = Builder(args.target, args.drafter, layout, replace(decoding, draft_step="model", verify_step="model"),
                      args.max_new_tokens, args.device, args.dtype, args.threads)
    per = args.tables_per_prompt if decoding.temperature > 0 else 1
    seeds = args.eval_seeds if decoding.temperature > 0 else 1
    # The held-out tables first: they hold the long generations, and a worker left alone at the end costs least
    # on a short one.
    held = [TableSpec(f"heldout-{i:03d}-{s}", tuple(ids), decoding.seed + s)
            for i, ids in enumerate(evals) for s in range(seeds)]
    paths = build_tables(builder, held, out / "tables", pair, args.workers, progress="held-out tables")
    short = replace(builder, max_new_tokens=min(args.train_new_tokens, args.max_new_tokens))
    specs = [TableSpec(f"train-{i:03d}-{s}", tuple(ids), decoding.seed + 1000 * i + s)
             for i, (_, ids) in enumerate(train) for s in range(per)]
    train_paths = build_tables(short, specs, out / "tables", pair, args.workers, progress="training tables")
    return ([ReplayTable.load(p) for p in train_paths], [ReplayTable.load(p) for p in paths], time.time() - t0)


def fit(state, run, train_tables, args):
    """The tree and logistic controllers, each imitating the oracle's decisions at --label-price (DAgger rounds on
    the training tables: ``rift_ada.trainers.oracle_labels``); each a unit. Returns ({"tree", "logistic"}, the
    labelled states of the tree's data: the levels quantile knobs take)."""
    from rift_ada.controllers import fit_logistic, fit_tree
    from rift_ada.refresh import LogisticController, TreeController
    from rift_ada.replay.oracle import solve
    from rift_ada.trainers.oracle_labels import imitate

    policies = None

    def oracle():
        nonlocal policies
        if policies is None:
            policies = [solve(t, args.draft_length, args.label_price) for t in train_tables]
        return policies

    def unit(family, fit_fn):
        def compute():
            res = imitate(train_tables, fit_fn, args.draft_length, args.label_price, args.dagger_rounds,
                          args.label_episodes, tuple(args.behaviour_periods), seed=args.seed, policies=oracle())
            for h in res.history:
                run.log({f"{family}/dagger/{k}": v for k, v in h.items()})
            ctrl = res.controller
            acc = float((np.asarray([ctrl.decide(x) for x in res.data.X]) == res.data.y).mean())
            run.log({f"{family}/train_accuracy": acc, f"{family}/states": len(res.data.y)})
            params = ({k: list(getattr(ctrl, k)) for k in ("feature", "threshold", "left", "right", "value")}
                      if family == "tree" else {"weights": ctrl.weights.tolist(), "bias": ctrl.bias})
            extra = {"rules": ctrl.describe()} if family == "tree" else {}
            data = ({"X": res.data.X.tolist(), "y": res.data.y.tolist(), "w": res.data.weight.tolist()}
                    if family == "tree" else {})
            return {"params": params, "history": res.history, "train_accuracy": acc, **extra, **data}
        return state.unit(family, compute)

    tree = unit("tree", lambda X, y, w: fit_tree(X, y, max_depth=args.tree_depth, min_samples_leaf=50, seed=args.seed,
                                                 ignore=TREE_IGNORES, sample_weight=w))
    logistic = unit("logistic", lambda X, y, w: fit_logistic(X, y, seed=args.seed, sample_weight=w))
    fitted = {"tree": TreeController(**{k: tuple(v) for k, v in tree["params"].items()}),
              "logistic": LogisticController(np.asarray(logistic["params"]["weights"]), logistic["params"]["bias"])}
    labelled = (np.asarray(tree["X"], dtype=np.float32), np.asarray(tree["y"]), np.asarray(tree["w"]))
    return fitted, labelled


KNOB_CANDIDATES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def choose_knobs(state, run, train_tables, fitted: dict, args) -> dict:
    """The tree's decision levels and the logistic controller's thresholds, where not given: on the *training*
    tables (replay; a unit), the candidate with the largest refresh savings against periodic refresh at matched AL
    among those at least as accurate as periodic refresh every 64 tokens (an operating point at high AL: the best
    overall is often at low AL, where periodic refresh pays least), or the best overall where none is.
    Returns {"tree": [levels], "logistic": [thresholds]}."""
    from dataclasses import replace as with_knob

    from rift_ada.refresh import PeriodicController
    from rift_ada.replay.process import replay_counts
    from rift_ada.tradeoff import matched_comparison

    def compute():
        k, eps = args.draft_length, 4
        rows = [{"family": "never", "knob": "-", **replay_counts(train_tables, None, k, eps, args.seed)}]
        rows += [{"family": "periodic", "knob": n, **replay_counts(train_tables, PeriodicController(n), k, eps,
                                                                   args.seed)} for n in (8, 16, 24, 32, 48, 64, 96)]
        for family, field in (("tree", "decision"), ("logistic", "threshold")):
            rows += [{"family": family, "knob": x, **replay_counts(
                train_tables, with_knob(fitted[family], **{field: x}), k, eps, args.seed)} for x in KNOB_CANDIDATES]
        summary = matched_comparison(rows)["families"]
        high = next(r["acceptance_length"] for r in rows if r["family"] == "periodic" and r["knob"] == 64)

        def best(candidates):
            ranked = sorted(candidates, key=lambda r: (r["refresh_savings"] is not None, r["refresh_savings"] or 0.0,
                                                       r["acceptance_length"]))
            return [ranked[-1]["knob"]] if ranked else []

        chosen = {}
        for family in ("tree", "logistic"):
            mine = [r for r in rows if r["family"] == family]
            chosen[family] = best([r for r in mine if r["acceptance_length"] >= high]) or best(mine)
            run.log({f"{family}/train_replay_savings": summary.get(family, {}).get("refresh_savings")})
        return {"chosen": chosen, "rows": [{k2: v for k2, v in r.items() if k2 != "per_prompt"} for r in rows]}

    given = {"tree": args.tree_decisions, "logistic": args.logistic_thresholds}
    if all(given.values()):
        return given
    chosen = state.unit("knobs", compute)["chosen"]
    return {family: knobs or chosen[family] for family, knobs in given.items()}


def learn(state, run, args, train_tables, cost_model) -> tuple[dict, float]:
    """One PPO / DQN run per learner and lambda on the replay environment over the training tables (a unit each, its
    export beside it), the reward shaped by the oracle's cost to go (``ReplayEnv(shaping=True)``, unless
    --no-shaping) and PPO's policy first cloning the decisions of the oracle whose cost is its reward (unless
    --no-clone): ({(learner, lambda): controller}, seconds spent on them over all sessions)."""
    from rift_ada.refresh.registry import KINDS

    learned, seconds = {}, 0.0
    for learner in learners_of(args):
        for lam in args.lams:
            name = f"{learner}-lam{lam:g}"
            unit = state.unit(name, lambda lr=learner, lam=lam, name=name: _train(
                state, run, args, lr, lam, name, train_tables, cost_model))
            seconds += unit["seconds"]
            learned[learner, lam] = KINDS[learner].load(state.path(f"{name}.pt"))  # the same weights, resumed or not
    return learned, seconds


def _train(state, run, args, learner, lam, name, train_tables, cost_model) -> dict:
    from rift_ada.envs import ReplayEnv
    from rift_ada.trainers.dqn import export_dqn, train_dqn
    from rift_ada.trainers.oracle_labels import reward_demonstrations
    from rift_ada.trainers.ppo import export_ppo, train_ppo
    from rift_ada.trainers.resume import atomic_write
    from rift_ada.trainers.wandb_logging import sb3_logger

    env = dict(draft_length=args.draft_length, lam=lam, refresh_cost=args.refresh_cost, reward=args.reward,
               costs=cost_model, shaping=args.shaping)
    env_fns = [lambda: ReplayEnv(train_tables, **env) for _ in range(args.n_envs)]
    prefix = f"{learner}_lam{lam:g}"
    run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/timesteps")
    fit_fn, export_fn, timesteps = {"ppo": (train_ppo, export_ppo, args.ppo_timesteps),
                                    "dqn": (train_dqn, export_dqn, args.dqn_timesteps)}[learner]
    extra = {"learning_rate": args.ppo_lr} if learner == "ppo" else {}
    if learner == "ppo" and args.clone:  # no entropy bonus on a clone: it would pull the clone back towards random
        extra.update(demonstrations=reward_demonstrations(train_tables, env, args.behaviour_periods,
                                                          args.label_episodes, args.seed),
                     value_warmup=args.ppo_warmup, ent_coef=0.0)
    model, venv = fit_fn(env_fns, timesteps, seed=args.seed, logger=sb3_logger(run.log, prefix),
                         progress=f"{learner.upper()} lambda={lam:g}", **extra)
    venv.close()
    atomic_write(state.path(f"{name}.pt"), export_fn(model, venv, lam).save)  # before the unit's JSON
    return {"lam": lam}


def sweep_points(args, observed, fitted: dict, knobs: dict, learned: dict) -> list[Point]:
    """The real decoder's points: every swept rule kind (``rift_ada.sweep.rule_points``; quantile knobs take their
    levels in the ``observed`` states), the tree at each decision level and the logistic controller at each threshold
    (``knobs``), each learner at each lambda."""
    from dataclasses import replace as with_knob

    for kind in sweep.unobserved(observed):
        print(f"warning: no states to take quantiles from; skipping the {kind} rule", file=sys.stderr)
    points = sweep.rule_points(args, observed)
    for family, field in (("tree", "decision"), ("logistic", "threshold")):
        knobs_of = knobs[family]
        points += [Point(family, x, with_knob(fitted[family], **{field: x}), sweep.unit_name(family, x))
                   for x in knobs_of]
    return points + [Point(ln, lam, learned[ln, lam], sweep.unit_name(ln, lam)) for ln, lam in learned]


def sweep_unit(ctx, point, layout, prompts, max_new_tokens, seeds) -> dict:
    """One point's counts on the held-out prompts in the real decoder (a unit; ``rift_ada.sweep.measure``)."""
    from rift_ada.layout import CacheLayout

    decoder = ctx.decoder(CacheLayout("full") if point.family == "full" else layout)
    return sweep.measure(point, decoder, prompts, max_new_tokens, seeds)


def replayed_points(state, heldout_tables, args) -> tuple[dict, list[tuple[Point, dict]]]:
    """From the held-out tables (replay; one unit): the full cache's counts (the reference every AL is divided by:
    its table row is exact, nothing is selected) and the oracle's point at each --oracle-lams (its expected
    schedule, exact over the grid; ``rift_ada.replay.oracle``)."""
    from rift_ada.replay.oracle import oracle_counts
    from rift_ada.replay.process import full_counts

    def compute():
        eps = args.oracle_episodes
        return {"full": full_counts(heldout_tables, args.draft_length, eps, args.seed),
                **{f"{lam:g}": oracle_counts(heldout_tables, args.draft_length, lam, eps, args.seed)
                   for lam in args.oracle_lams}}

    stored = state.unit("replayed", compute)
    return stored["full"], [(p, stored[f"{p.knob:g}"]) for p in sweep.oracle_points(args.oracle_lams)]


def replay_sweep(state, points: list[Point], heldout_tables, args) -> list[dict]:
    """Every real-decoder point again, in replay on the held-out tables (a unit): the same comparison in expectation
    over ``--oracle-episodes`` replays per table, in the world the oracle's points come from, so the share of the
    oracle's saving a controller captures is measured like for like."""
    from rift_ada.replay.process import replay_counts

    def compute():
        return {"counts": [replay_counts(heldout_tables, p.controller, args.draft_length, args.oracle_episodes,
                                         args.seed) for p in points]}

    return state.unit("replay-sweep", compute)["counts"]


def run_sweep(state, points: list[Point], ctx, setting, layout, prompts, args) -> list[dict]:
    """One unit per point on the held-out prompts: its counts over --eval-seeds seeds."""
    from .workers import run_units

    units = [(p.unit, sweep_unit, (p, layout, prompts, args.max_new_tokens, args.eval_seeds)) for p in points]
    # The slowest points first (never refreshing decodes the most rounds), so no worker is left with one at the end.
    slow = [p.unit for p in points if p.family == "never"]
    return run_units(state, units, ctx, setting, args.workers, "tradeoff sweep", first=slow)
