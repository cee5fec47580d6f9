"""Training a joint controller (refresh and draft length, ``rift_ada.joint``) on replay tables with the time reward,
and choosing the fixed settings it is compared with on the same tables.

- ``choose_baselines``: the best fixed (k, period) (speculate-never, k = 0, among the candidates) by modelled tokens per
  second over the training tables priced at every measured context length, and a context-length table of k (the best
  k per length at that period).
- ``fit_gains``: the "gain" family, an MLP regressing each action's expected time gain over greedy decoding, read
  from the tables, on the observation (DAgger over its own states); with ``predicts="tokens"`` the "priced" family,
  the same regression of each action's expected tokens, priced when it decides by the deciding machine's costs.
- ``train_ppo_joint``: PPO (stable-baselines3) in ``JointReplayEnv`` from the gain family's clone; ``export_joint``
  turns its policy into a torch-only ``JointPolicy`` (VecNormalize's observation statistics baked in).
- ``run_job`` / ``finish``: the main job's ``--joint`` branch (experiments/train_controller.py). Background:
  docs/joint.md.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from rift_ada.joint.control import DRAFT_LENGTHS, FixedJoint, JointPolicy, actions, price_vector
from rift_ada.joint.costs import RoundCosts
from rift_ada.joint.replay import replay_joint

PERIODS = (8, 16, 32, 64, 128, None)  # None: never refresh
FAMILIES = ("gain", "priced", "ppo")  # the learned joint families, in training order (PPO starts from the gain clone)
RESULT_FILES = ("joint.json", *(f"controller-joint-{f}.pt" for f in FAMILIES))


def by_length(tables, lengths) -> dict:
    """{measured length: the tables whose prompt length is nearest it} (lengths no table is near are left out)."""
    groups: dict = {}
    for t in tables:
        groups.setdefault(min(lengths, key=lambda n: abs(n - t.prompt_len)), []).append(t)
    return {int(n): groups[n] for n in sorted(groups)}


def modelled(tables, controller, costs: RoundCosts, episodes: int = 2, seed: int = 0) -> dict:
    """``controller`` replayed over ``tables``, each priced at its own prompt length: {measured length: replay_joint's
    numbers over the tables nearest it}, and "all": the mean over lengths of seconds per token, inverted (each length
    the same tokens: the bench's families-and-lengths mix)."""
    k_max = max(controller.k_max, 1)
    per = {n: replay_joint(group, controller.act, costs, k_max, episodes, seed)
           for n, group in by_length(tables, costs.lengths).items()}
    spt = [p["seconds"] / p["tokens"] for p in per.values() if p["tokens"]]
    return {**per, "all": {"tokens_per_s": len(spt) / sum(spt) if spt else 0.0}}


def choose_baselines(tables, costs: RoundCosts, draft_lengths=DRAFT_LENGTHS, periods=PERIODS, episodes: int = 2,
                     seed: int = 0, progress: bool = False) -> dict:
    """{"best_fixed": spec, "length_table": spec, "grid": [(k, period, modelled tokens/s over all lengths)]}: specs as
    ``rift_ada.joint.baseline`` reads them; each table priced at its own prompt length."""
    from tqdm.auto import tqdm

    grid = [(k, p) for k in sorted(set(draft_lengths)) for p in (periods if k else (None,))]
    scores = {}
    for k, p in tqdm(grid, desc="fixed (k, period)", disable=not progress):
        scores[k, p] = modelled(tables, FixedJoint(k, p), costs, episodes, seed)
    (k, period), _ = max(scores.items(), key=lambda kv: kv[1]["all"]["tokens_per_s"])
    # The length table: at the best fixed period, each measured length's best k (a refresh period means nothing at
    # k = 0, so a length whose best is to not speculate takes k = 0 whatever the period).
    ks, lengths = [], [n for n in scores[k, period] if n != "all"]
    for n in lengths:
        at = {kk: s[n]["tokens_per_s"] for (kk, pp), s in scores.items() if pp == period or kk == 0}
        ks.append(max(at, key=at.get))
    bounds = [0] + [(a + b) // 2 for a, b in zip(lengths, lengths[1:])]
    return {"best_fixed": {"kind": "fixed", "k": k, "period": period},
            "length_table": {"kind": "length-table", "lengths": bounds, "ks": ks, "period": period},
            "grid": [[kk, pp, s["all"]["tokens_per_s"]] for (kk, pp), s in scores.items()]}


def values(env, horizon: int = 16) -> np.ndarray:
    """Each action's expected tokens at the env's state, read from the table (what no controller sees): the round's
    expected emitted tokens (1 + the sum of the products of its drafts' acceptance probabilities); a refresh also
    counts the acceptance its new selection adds over the next ``horizon`` tokens (its lasting effect, beyond this
    round). What the "priced" family learns (its price is subtracted when it decides); less :func:`prices`, the
    expected gain over greedy decoding the "gain" family learns."""
    r = env.replay
    out, fresh = np.empty(len(env.choices)), (r.g - r.pending) // r.G
    for i, (refresh, k) in enumerate(env.choices):
        row, kk = (fresh if refresh else r.row), min(k, r.max_new - r.g - 1)
        out[i] = 1.0 + float(np.cumprod(r.acc[row, r.g:r.g + kk]).sum()) if kk > 0 else 1.0
        if refresh:
            out[i] += float(r.acc[fresh, r.g:r.g + horizon].sum() - r.acc[r.row, r.g:r.g + horizon].sum())
    return out


def prices(env) -> np.ndarray:
    """Each action's modelled seconds at the env's state in the episode's plain target steps, the round's drafts
    clipped to the tokens left (``price_vector``)."""
    r = env.replay
    return price_vector(env.costs, env.choices, r.prompt_tokens + r.g, r.since_draft, env.plain_s, r.max_new - r.g - 1)


def gain_samples(tables, costs: RoundCosts, draft_lengths=DRAFT_LENGTHS, episodes: int = 96, explore: float = 0.5,
                 seed: int = 0, policy: JointPolicy | None = None, predicts: str = "gain"):
    """(observations, gains per action, or expected tokens with ``predicts="tokens"``) at the states reached in
    ``JointReplayEnv`` by ``policy`` (None: the best action in hindsight) or, with probability ``explore``, a random
    action."""
    from rift_ada.envs.joint_env import JointReplayEnv

    env = JointReplayEnv(tables, costs, draft_lengths)
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done = False
        while not done:
            v = values(env)
            g = v - prices(env)
            xs.append(obs)
            ys.append(g if predicts == "gain" else v)
            if rng.random() < explore:
                a = int(rng.integers(len(env.choices)))
            elif policy is None:
                a = int(g.argmax())
            else:
                a = int(policy.act_batch(obs[None], policy.price(env.replay.state)[None])[0])
            obs, _, done, _, _ = env.step(a)
    return np.asarray(xs, np.float32), np.asarray(ys, np.float32)


def fit_gains(tables, costs: RoundCosts, draft_lengths=DRAFT_LENGTHS, episodes: int = 96, epochs: int = 30,
              dagger_rounds: int = 3, seed: int = 0, baselines: dict | None = None,
              predicts: str = "gain") -> JointPolicy:
    """The "gain" family: an MLP regressing each action's expected gain on the observation (the conditional mean of
    what the table knows, given what the controller sees); it takes the action of highest predicted gain. Fitted
    first on the states hindsight-best and random actions reach, then ``dagger_rounds - 1`` times more adding the
    states its own last fit reaches (DAgger): where it goes, e.g. long plain stretches on novel code, it learns what
    drafting would gain there. ``predicts="tokens"``: the "priced" family, the same regression of each action's
    expected tokens (:func:`values`), priced when it decides by the costs of the machine it runs on."""
    xs, ys, policy = [], [], None
    for r in range(dagger_rounds):
        x, y = gain_samples(tables, costs, draft_lengths, episodes, 0.5 if policy is None else 0.1, seed + 7919 * r,
                            policy, predicts)
        xs.append(x)
        ys.append(y)
        policy = _fit(np.concatenate(xs), np.concatenate(ys), costs, draft_lengths, epochs, seed, baselines, predicts)
    return policy


def _fit(x, y, costs, draft_lengths, epochs: int, seed: int, baselines, predicts: str = "gain") -> JointPolicy:
    from rift_ada.refresh.mlp import build_mlp

    mean, var = x.mean(0).astype(np.float64), x.var(0).astype(np.float64)
    torch.manual_seed(seed)
    net = build_mlp([x.shape[1], 64, 64, y.shape[1]], "tanh")
    xt = torch.as_tensor(np.clip((x - mean) / np.sqrt(var + 1e-8), -10, 10), dtype=torch.float32)
    yt = torch.as_tensor(y)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(xt), generator=g).split(256):
            loss = torch.nn.functional.mse_loss(net(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return JointPolicy(net.eval(), actions(draft_lengths), costs, mean, var, "gain" if predicts == "gain" else "priced",
                       10.0, 1e-8, dict(baselines or {}), predicts=predicts)


def train_ppo_joint(tables, costs: RoundCosts, timesteps: int, draft_lengths=DRAFT_LENGTHS, seed: int = 0,
                    n_envs: int = 4, start: JointPolicy | None = None, clone_episodes: int = 64, logger=None,
                    progress: str | None = "PPO (joint)"):
    """PPO on ``JointReplayEnv`` (``n_envs`` copies, VecNormalize), from a clone of ``start``'s decisions (None:
    from scratch) with its critic warmed up on the clone frozen: (model, vec_normalize)."""
    from rift_ada.envs.joint_env import JointReplayEnv

    from .ppo import train_ppo

    demos = None
    if start is not None:  # clone a controller's decisions at the states it reaches first
        obs, act = visited(tables, costs, start, draft_lengths, clone_episodes, seed)
        demos = (obs, act, None)
    fns = [lambda: JointReplayEnv(tables, costs, draft_lengths) for _ in range(n_envs)]
    # gamma 0.9: a round's reward is mostly its own; a refresh's lasting effect spans a few rounds, not hundreds.
    return train_ppo(fns, timesteps, seed=seed, net_arch=(64, 64), n_steps=256, ent_coef=0.003, logger=logger,
                     progress=progress, demonstrations=demos, value_warmup=timesteps // 4 if demos else 0,
                     learning_rate=3e-5, gamma=0.9)


def visited(tables, costs: RoundCosts, policy: JointPolicy, draft_lengths=DRAFT_LENGTHS, episodes: int = 64,
            seed: int = 0):
    """(observations, ``policy``'s actions) at the states it reaches in ``JointReplayEnv``."""
    from rift_ada.envs.joint_env import JointReplayEnv

    env = JointReplayEnv(tables, costs, draft_lengths)
    xs = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done = False
        while not done:
            xs.append(obs)
            obs, _, done, _, _ = env.step(int(policy.act_batch(obs[None])[0]))
    x = np.asarray(xs, np.float32)
    return x, policy.act_batch(x)


def export_joint(model, vec_normalize, costs: RoundCosts, draft_lengths=DRAFT_LENGTHS, family: str = "ppo",
                 baselines: dict | None = None) -> JointPolicy:
    """The SB3 policy's actor (its MLP and action layer) as a ``JointPolicy``."""
    from .ppo import copy_mlp, normalisation

    policy = model.policy
    net, sizes, _ = copy_mlp(list(policy.mlp_extractor.policy_net) + [policy.action_net])
    mean, var, eps, clip = normalisation(vec_normalize, sizes[0])
    return JointPolicy(net, actions(draft_lengths), costs, mean, var, family, clip, eps, dict(baselines or {}))


__all__ = ["PERIODS", "choose_baselines", "export_joint", "modelled", "train_ppo_joint"]


# --- the main job's --joint branch (experiments/train_controller.py) -------------------------------------------------
def add_joint_options(parser) -> None:
    g = parser.add_argument_group("joint controller (--joint)")
    g.add_argument("--joint", action="store_true",
                   help="train joint controllers (refresh and draft length, rift_ada.joint) on the tables instead of "
                        "the refresh-only study; exports controller-joint-<family>.pt (default --output-dir "
                        "runs/joint)")
    g.add_argument("--joint-lengths", type=int, nargs="+", default=[1024, 4096, 7168],
                   help="context lengths the round costs are measured at (the controllers price every length "
                        "between)")
    g.add_argument("--draft-lengths", type=int, nargs="+", default=list(DRAFT_LENGTHS),
                   help="the draft lengths a joint controller chooses from (0: a plain target step)")
    g.add_argument("--joint-timesteps", type=int, default=100_000, help="PPO's replay steps (joint)")


def check_joint_args(args) -> None:
    """ValueError (one line) for joint options no run can use (checked with --joint only: the refresh-only job's
    --draft-length may be below the joint default set's largest k)."""
    if not args.joint:
        return
    if min(args.draft_lengths) < 0 or max(args.draft_lengths) < 1 or max(args.draft_lengths) > args.draft_length:
        raise ValueError(f"--draft-lengths must be integers in 0..--draft-length ({args.draft_length}), one >= 1; got "
                         f"{args.draft_lengths}")
    if min(args.joint_lengths) < 16 or args.joint_timesteps < 1:
        raise ValueError("--joint-lengths must be >= 16 tokens and --joint-timesteps >= 1")


def length_tables(out, pair, args, layout, decoding) -> list:
    """Training tables at every --joint-lengths length other than --input-tokens (whose tables the job already
    built): the same code bases and families, --train-new-tokens each, kept in ``<output-dir>/tables`` as
    ``train-<length>-<i>-<seed>`` (a resumed job reuses them). Acceptance at 4K is not acceptance at 1K, so each
    length the controller decides at is learned from tables of that length."""
    from rift_ada.data import encode
    from rift_ada.data.sources import build_source_mix
    from rift_ada.models import check_fits
    from rift_ada.replay import ReplayTable
    from rift_ada.replay.build import build_tables

    from .controller_job.stages import table_builder, training_specs

    new = min(args.train_new_tokens, args.max_new_tokens)
    specs = []
    for n in sorted(set(args.joint_lengths) - {args.input_tokens}):
        for model in (pair.target, pair.draft):
            check_fits(model, n + new, "a --joint-lengths length + --train-new-tokens")
        mix = build_source_mix(pair.tokenizer, args.train_sources.split(","), args.task, args.prompts_per_source, n,
                               args.seed + 1)
        specs += training_specs(f"train-{n}", [encode(pair.tokenizer, t.prompt) for _, t in mix], args, decoding)
    paths = build_tables(table_builder(args, layout, decoding, new), specs, out / "tables", pair, args.workers,
                         progress="training tables per length")
    return [ReplayTable.load(p) for p in paths]


def run_job(out, state, run, args, pair, layout, decoding, train_tables, heldout_tables) -> dict:
    """Training tables at the other --joint-lengths, costs, baselines, the gain and priced families and PPO (from the
    gain family's clone), each a resumable unit; exports one file per family and ``joint.json`` (each row's modelled
    tokens/s on the training and the held-out tables per length)."""
    from dataclasses import asdict, fields, replace

    from rift_ada.joint.control import baseline
    from rift_ada.joint.costs import measure_round_costs
    from rift_ada.speculative import SpeculativeDecoder

    def measure():
        from rift_ada.data import build_tasks, encode

        steps = "static" if decoding.verify_step == "model" else decoding.verify_step
        dec = SpeculativeDecoder.for_pair(pair, layout, replace(decoding, draft_step=steps, verify_step=steps,
                                                                draft_length=max(args.draft_lengths)))
        prompts = {n: encode(pair.tokenizer, build_tasks(pair.tokenizer, "low", n=1, input_tokens=n, seed=args.seed,
                                                         split="train")[0].prompt) for n in args.joint_lengths}
        return measure_round_costs(dec, prompts, args.draft_lengths, progress=True).to_dict()

    train_tables = list(train_tables) + length_tables(out, pair, args, layout, decoding)
    costs = RoundCosts.from_dict(state.unit("joint_costs", measure))
    base = state.unit("joint_baselines", lambda: choose_baselines(train_tables, costs, args.draft_lengths,
                                                                  seed=args.seed, progress=True))
    baselines = {k: base[k] for k in ("best_fixed", "length_table")}
    lay = {f.name: getattr(layout, f.name) for f in fields(layout) if f.init}
    files = {}

    def family(name, train):
        path = state.path(f"joint-{name}.pt")

        def compute():
            policy = train()
            policy.baselines, policy.layout = baselines, lay
            policy.save(path)
            return {"file": path.name}

        state.unit(f"joint_{name}", compute)
        files[name] = JointPolicy.load(path)

    family("gain", lambda: fit_gains(train_tables, costs, args.draft_lengths, seed=args.seed))
    family("priced", lambda: fit_gains(train_tables, costs, args.draft_lengths, seed=args.seed, predicts="tokens"))

    def ppo():
        from .wandb_logging import sb3_logger

        model, vn = train_ppo_joint(train_tables, costs, args.joint_timesteps, args.draft_lengths, seed=args.seed,
                                    start=files["gain"], logger=sb3_logger(run.log, "joint/ppo/"))
        return export_joint(model, vn, costs, args.draft_lengths, "ppo")

    family("ppo", ppo)
    rows = {"greedy": FixedJoint(0), **{k: baseline(v) for k, v in baselines.items()}, **files}
    train = {name: modelled(train_tables, c, costs, seed=args.seed) for name, c in rows.items()}
    summary = {"costs": asdict(costs), "baselines": baselines,
               # the family to use: the best modelled speed on the training tables (never the held-out ones)
               "chosen": max(files, key=lambda name: train[name]["all"]["tokens_per_s"]), "train_modelled": train,
               "heldout_modelled": {name: modelled(heldout_tables, c, costs, seed=args.seed)
                                    for name, c in rows.items()}}
    for name, policy in files.items():
        policy.save(out / f"controller-joint-{name}.pt")
    (out / "joint.json").write_text(json.dumps(summary, indent=1))
    return summary


def finish(out, state, run, args, *inputs) -> int:
    """Run the joint job, print and log (W&B) each row's modelled tokens/s on the training and the held-out tables per
    length."""
    summary = run_job(out, state, run, args, *inputs)
    for which in ("train", "heldout"):
        rows = summary[f"{which}_modelled"]
        lengths = [n for n in next(iter(rows.values())) if n != "all"]
        print(f"modelled decode tokens/s on the {which} tables at {', '.join(map(str, lengths))} tokens (measured "
              f"round costs; bench_decode.py --controller measures them):")
        for name, m in rows.items():
            print(f"  {name:>12}: " + " / ".join(f"{m[n]['tokens_per_s']:.1f}" for n in lengths))
            run.log({f"joint/{which}/{name}/tokens_per_s_{n}": m[n]["tokens_per_s"] for n in lengths})
    print(f"best fixed: {summary['baselines']['best_fixed']}; files: " + ", ".join(
        f"{out}/controller-joint-{f}.pt" for f in FAMILIES) + f"; best on the training tables: {summary['chosen']}")
    state.store("done", {}, 0.0)
    run.finish()
    return 0
