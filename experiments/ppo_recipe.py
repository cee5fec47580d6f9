"""What each part of PPO's recipe on replay does on code it never trained on: leave one training code base out.

    python experiments/ppo_recipe.py --run runs/controller      # about 15 minutes per variant on one core

Takes the training tables a finished main job built (``<run>/tables/train-*``) and its options (lambda, refresh
cost, timesteps, label episodes, behaviour periods), and per variant and per training code base trains PPO on the
other code bases' tables and replays the exported controller on that code base's, pooled over the code bases; then
compares it with periodic refresh (refresh savings at matched AL) and with the oracle of the same reward (the
share of its saving captured). Variants:

- ``clone only``: the policy cloned from the oracle's decisions (trainers/oracle_labels.demonstrations), no PPO;
- ``plain``: PPO from a random policy (lr 3e-4, entropy bonus 0.01), the reward shaped;
- ``clone, then PPO``: the clone, then PPO at lr 3e-4 with entropy bonus 0.01 (no warm-up);
- ``default``: the main job's recipe: the clone, the critic warmed up with the policy frozen (--ppo-warmup), then
  PPO at --ppo-lr without entropy bonus.

Writes ``<out>/ppo_recipe.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rift_ada.cli import ArgumentParser, fail
from rift_ada.data.sources import mix_sources

VARIANTS = ("clone only", "plain", "clone, then PPO", "default")


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/controller", help="a main job's --output-dir")
    p.add_argument("--out", default="runs/ppo-recipe")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"of: {', '.join(VARIANTS)}")
    p.add_argument("--periods", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64, 96, 128])
    p.add_argument("--episodes", type=int, default=8, help="replays per table and point (sampling)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: PPO's small updates run fastest on one; several copies of this script "
                        "side by side with more each crawl)")
    args = p.parse_args(argv)
    try:
        import torch

        torch.set_num_threads(args.threads)
        from rift_ada.replay.table import job_tables

        opts, train, _ = job_tables(args.run)
        unknown = [v for v in args.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown}; choose among {list(VARIANTS)}")
    except (FileNotFoundError, ValueError, OSError) as e:
        return fail(e)
    results = {v: cross_validate(train, opts, v, args) for v in args.variants}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ppo_recipe.json").write_text(json.dumps({"options": vars(args), "results": results}, indent=1))
    print(f"\n{len(train)} training tables, each code base left out in turn; lambda {opts['lams'][0]:g}")
    print("| variant | AL | refreshes per 1K | refresh savings vs periodic | share of the oracle's saving |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        pct = "-" if r["refresh_savings"] is None else f"{100 * r['refresh_savings']:.1f}%"
        share = "-" if r["oracle_share"] is None else f"{r['oracle_share']:.2f}"
        print(f"| {name} | {r['acceptance_length']:.2f} | {r['refreshes_per_1k']:.1f} | {pct} | {share} |")
    return 0


def cross_validate(train, opts, variant, args) -> dict:
    from rift_ada.envs import ReplayEnv
    from rift_ada.refresh import PeriodicController
    from rift_ada.replay.oracle import oracle_counts
    from rift_ada.replay.process import merge_tables, replay_counts
    from rift_ada.tradeoff import matched_comparison
    from rift_ada.trainers.oracle_labels import reward_demonstrations
    from rift_ada.controllers import export_ppo
    from rift_ada.trainers.ppo import train_ppo

    k, lam, seed = opts.get("draft_length", 11), opts["lams"][0], opts.get("seed", 0)
    env = dict(draft_length=k, lam=lam, refresh_cost=opts.get("refresh_cost", 2.0), shaping=opts.get("shaping", True))
    source = mix_sources(str(opts.get("train_sources", "x")), len(train))
    sources = max(source) + 1
    recipe = {"clone only": dict(timesteps=0, clone=True, learning_rate=3e-4, ent_coef=0.01, value_warmup=0),
              "plain": dict(clone=False, learning_rate=3e-4, ent_coef=0.01, value_warmup=0),
              "clone, then PPO": dict(clone=True, learning_rate=3e-4, ent_coef=0.01, value_warmup=0),
              "default": dict(clone=True, learning_rate=opts.get("ppo_lr", 1e-4), ent_coef=0.0,
                              value_warmup=opts.get("ppo_warmup", 20_000))}[variant]
    timesteps = recipe.pop("timesteps", opts.get("ppo_timesteps", 100_000))
    per_prompt = []
    for c in range(sources):
        fold = [t for t, s in zip(train, source) if s != c]
        extra = {}
        if recipe["clone"]:
            extra["demonstrations"] = reward_demonstrations(fold, env, opts.get("behaviour_periods", (16, 192)),
                                                            opts.get("label_episodes", 4), seed)
        model, venv = train_ppo([lambda: ReplayEnv(fold, **env) for _ in range(opts.get("n_envs", 8))], timesteps,
                                seed=seed, progress=f"{variant}: code base {c + 1}/{sources} left out",
                                **{key: v for key, v in recipe.items() if key != "clone"}, **extra)
        left_out = [t for t, s in zip(train, source) if s == c]
        per_prompt += replay_counts(left_out, export_ppo(model, venv, lam), k, args.episodes, seed)["per_prompt"]
    rows = [{"family": "never", "knob": "-", **replay_counts(train, None, k, args.episodes, seed)}]
    rows += [{"family": "periodic", "knob": n, **replay_counts(train, PeriodicController(n), k, args.episodes, seed)}
             for n in args.periods]
    rows.append({"family": "ppo", "knob": lam, **merge_tables(per_prompt)})
    price = lam * env["refresh_cost"]  # the oracle whose cost is the env's reward
    rows += [{"family": "oracle", "knob": x, **oracle_counts(train, k, x, args.episodes, seed)}
             for x in sorted(set(opts.get("oracle_lams", [1, 2, 4, 8, 16]) + [price]))]
    matched_comparison(rows)
    ppo = next(r for r in rows if r["family"] == "ppo")
    print(f"{variant}: AL {ppo['acceptance_length']:.2f} at {ppo['refreshes_per_1k']:.1f} refreshes per 1K, savings "
          f"{ppo['refresh_savings']}, share {ppo['oracle_share']}", file=sys.stderr)
    return {key: ppo[key] for key in ("acceptance_length", "refreshes_per_1k", "refresh_savings", "oracle_share")}


if __name__ == "__main__":
    sys.exit(main())
