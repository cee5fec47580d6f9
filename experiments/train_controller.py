"""Learn when to refresh the draft's RIFT cache, and compare every controller family on a tradeoff curve.

    python experiments/train_controller.py                  # built-in testbed, about 15 minutes on 2 CPU cores

1. Counterfactual data on training prompts: at many decoder states, fork, refresh in one branch only, and compare
   the accepted tokens of the next rounds.
2. A logistic controller fitted on those labels; a PPO controller per refresh-cost weight lambda in RefreshEnv.
3. Every family swept across its knob on held-out prompts (periodic: period; threshold: acceptance level;
   logistic: decision threshold; PPO: lambda), giving acceptance length (AL) versus refreshes per 1K tokens.
4. Output folder: tradeoff.csv, tradeoff.png, metrics.json, the best learned controller exported
   (controller.json or controller.pt, loadable without scikit-learn or stable-baselines3), and a W&B run (offline by
   default: ``wandb sync <output-dir>/wandb/offline-run-*`` uploads it later).
5. Prints, per learned family, the % fewer refreshes than periodic refresh at matched AL and the AL gain at a matched
   refresh count.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from controllers import LogisticController, NeverController, PeriodicController, ThresholdController
from rift_ada.cli import require_positive
from rift_ada.metrics import summarize
from rift_ada.signals import decider
from rift_ada.tradeoff import matched_comparison


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("models and task")
    m.add_argument("--target", default="testbed", help="'testbed', a local HF folder or a hub id")
    m.add_argument("--drafter", default="self", help="'self', 'testbed' or a draft folder / hub id")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    m.add_argument("--budget", type=int, default=512, help="draft KV budget in tokens (default 25%% of 2K input)")
    m.add_argument("--window-fraction", type=float, default=0.5)
    m.add_argument("--scorer", default="snapkv")
    m.add_argument("--draft-length", type=int, default=11)
    m.add_argument("--task", default="low,high",
                   help="task family: low, mixed, high, or a comma-separated mix (e.g. low,high: the controller must "
                        "learn where a refresh pays off)")
    m.add_argument("--input-tokens", type=int, default=2048)
    m.add_argument("--max-new-tokens", type=int, default=256)
    m.add_argument("--train-prompts", type=int, default=8, help="prompts for counterfactual data and PPO")
    m.add_argument("--eval-prompts", type=int, default=6, help="held-out prompts for the tradeoff curves")
    t = p.add_argument_group("training")
    t.add_argument("--horizon", type=int, default=8, help="rounds per counterfactual branch")
    t.add_argument("--label-every", type=int, default=2, help="label every n-th round of the data trajectories")
    t.add_argument("--refresh-cost", type=float, default=2.0, help="cost of one refresh in draft-token equivalents")
    t.add_argument("--label-margin", type=float, default=None,
                   help="label a state 'refresh' when refreshing gains more accepted tokens than this over the "
                        "horizon (default: the refresh cost)")
    t.add_argument("--ppo-timesteps", type=int, default=2000, help="PPO environment steps (rounds) per lambda")
    t.add_argument("--lams", type=float, nargs="+", default=[1.0, 4.0], help="refresh-cost weights for PPO")
    k = p.add_argument_group("tradeoff sweep")
    k.add_argument("--periods", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    k.add_argument("--acc-thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.85])
    k.add_argument("--logistic-thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.85])
    o = p.add_argument_group("output")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--output-dir", default="runs/controller")
    o.add_argument("--wandb-project", default="rift-ada")
    o.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    o.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    require_positive(p, args, ("budget", "max_new_tokens", "train_prompts", "eval_prompts", "horizon",
                               "ppo_timesteps", "draft_length", "label_every"))
    if any(x <= 0 for x in args.periods) or any(x < 0 for x in args.lams) or args.refresh_cost < 0:
        p.error("periods must be > 0; lambdas and the refresh cost >= 0")
    if any(not 0 < x < 1 for x in args.acc_thresholds + args.logistic_thresholds):
        p.error("thresholds must lie in (0, 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    import wandb

    from envs import RefreshEnv
    from rift_ada.data import encode_prompts
    from rift_ada.models import load_pair
    from rift_ada.policies import CachePolicy
    from rift_ada.speculative import SpeculativeDecoder
    from trainers import counterfactual
    from trainers.ppo import export_ppo, train_ppo
    from trainers.wandb_logging import sb3_logger

    try:
        pair = load_pair(args.target, args.drafter, device=args.device)
        policy = CachePolicy("rift-ada", budget=args.budget, window_fraction=args.window_fraction, scorer=args.scorer)
        enc = lambda tasks: encode_prompts(pair.tokenizer, tasks)  # noqa: E731
        train_tasks = mixed_tasks(pair.tokenizer, args.task, args.train_prompts, args.input_tokens, args.seed + 1,
                                  "train")
        eval_tasks = mixed_tasks(pair.tokenizer, args.task, args.eval_prompts, args.input_tokens, args.seed, "eval")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train_ids, eval_ids = enc(train_tasks), enc(eval_tasks)
    draft = None if pair.self_speculative else pair.draft
    make_decoder = lambda pol=policy: SpeculativeDecoder(pair.target, draft, pol, args.draft_length,  # noqa: E731
                                                         eos_token_id=pair.tokenizer.eos_token_id, seed=args.seed)
    run = wandb.init(project=args.wandb_project, mode=args.wandb_mode, dir=str(out), config=vars(args),
                     job_type="train_controller")
    timings = {}

    # 1. Counterfactual data ------------------------------------------------------------------------------------
    t0 = time.time()
    data = counterfactual.collect(make_decoder(), train_ids, args.max_new_tokens, horizon=args.horizon,
                                  every=args.label_every, seed=args.seed)
    labels = data.labels(margin=args.refresh_cost if args.label_margin is None else args.label_margin)
    timings["counterfactual_s"] = time.time() - t0
    run.log({"data/states": len(labels), "data/positive_rate": float(labels.mean()),
             "data/mean_gain": float(data.gain.mean())})
    print(f"counterfactual data: {len(labels)} states, {labels.mean():.1%} where refreshing paid off "
          f"({timings['counterfactual_s']:.0f} s)", file=sys.stderr)

    # 2. Logistic and PPO ---------------------------------------------------------------------------------------
    logistic = None
    if len(np.unique(labels)) == 2:
        logistic = LogisticController.fit(data.X, labels, seed=args.seed)
        p_train = logistic.sklearn_model.predict_proba(data.X)[:, 1]
        run.log({"logistic/train_accuracy": float(((p_train > 0.5) == labels).mean())})
    else:
        print(f"warning: every counterfactual label is {labels[0]}; skipping the logistic controller (collect "
              "more states with --train-prompts / --label-every, or change --label-margin)", file=sys.stderr)
    ppo_controllers = []
    t0 = time.time()
    for lam in args.lams:
        env_fns = [lambda i=i: RefreshEnv(tasks=train_tasks, pair=pair, budget=args.budget,
                                          window_fraction=args.window_fraction, scorer=args.scorer,
                                          draft_length=args.draft_length, max_new_tokens=args.max_new_tokens, lam=lam,
                                          refresh_cost=args.refresh_cost, decoder_seed=i)
                   for i in range(2)]
        model, venv = train_ppo(env_fns, args.ppo_timesteps, seed=args.seed, logger=sb3_logger(run, f"ppo_lam{lam:g}"),
                                callback=_progress(args.ppo_timesteps, f"PPO lambda={lam:g}"))
        ppo_controllers.append(export_ppo(model, venv, lam))
    timings["ppo_s"] = time.time() - t0

    # 3. Tradeoff sweep on held-out prompts -----------------------------------------------------------------------
    t0 = time.time()
    points = [("never", "-", NeverController())]
    points += [("periodic", p, PeriodicController(p)) for p in args.periods]
    points += [("threshold", x, ThresholdController([("acc_mean", "<", x)])) for x in args.acc_thresholds]
    if logistic is not None:
        points += [("logistic", x, LogisticController(logistic.weights, logistic.bias, x))
                   for x in args.logistic_thresholds]
    points += [("ppo", c.lam, c) for c in ppo_controllers]
    rows = []
    full = summarize([make_decoder(CachePolicy("full")).generate(ids, args.max_new_tokens) for ids in eval_ids],
                     args.max_new_tokens)
    dec = make_decoder()
    for family, knob, ctrl in tqdm(points, desc="tradeoff sweep"):
        res = summarize([dec.generate(ids, args.max_new_tokens, decider(ctrl)) for ids in eval_ids],
                        args.max_new_tokens)
        rows.append({"family": family, "knob": knob, "acceptance_length": res["acceptance_length"],
                     "refreshes_per_1k": res["refreshes_per_1k_tokens"], "refreshes": res["refreshes"],
                     "al_vs_full": res["acceptance_length"] / full["acceptance_length"]})
    timings["sweep_s"] = time.time() - t0

    # 4. Matched comparisons against periodic refresh, the export, and the logs ---------------------------------
    summary = matched_comparison(rows)  # adds refresh_savings / al_gain to the learned rows
    best = max((r for r in rows if r["family"] in ("logistic", "ppo")),  # the learned controllers
               key=lambda r: (r["refresh_savings"] if r["refresh_savings"] is not None else -1.0,
                              r["acceptance_length"]))
    best_ctrl = next(c for f, k, c in points if f == best["family"] and k == best["knob"])
    ctrl_path = out / ("controller.pt" if best["family"] == "ppo" else "controller.json")
    best_ctrl.save(ctrl_path)
    data_stats = {"states": int(len(labels)), "positive_rate": float(labels.mean()), "mean_gain": float(data.gain.mean())}
    _write_outputs(out, rows, full, summary, timings, args, ctrl_path, best, run, data_stats)
    timings["total_s"] = time.time() - t_start
    run.summary.update({"total_seconds": timings["total_s"]})
    run.finish()

    print(f"\nfull-cache AL {full['acceptance_length']:.3f} | budget {args.budget} | {args.eval_prompts} held-out prompts")
    print(f"{'family':>10} {'knob':>6} {'AL':>7} {'AL/full':>8} {'ref/1K':>8}")
    for r in rows:
        print(f"{r['family']:>10} {str(r['knob']):>6} {r['acceptance_length']:7.3f} {r['al_vs_full']:8.3f} "
              f"{r['refreshes_per_1k']:8.2f}")
    for fam, s in summary["families"].items():
        sav = "n/a" if s["refresh_savings"] is None else f"{100 * s['refresh_savings']:.1f}%"
        gain = "n/a" if s["al_gain"] is None else f"{s['al_gain']:+.3f}"
        print(f"{fam}: {sav} fewer refreshes than periodic at matched AL; AL gain at matched refresh count {gain}")
    print(f"exported {best['family']} (knob {best['knob']}) -> {ctrl_path}; total {timings['total_s']:.0f} s")
    return 0


def mixed_tasks(tokenizer, families: str, n: int, input_tokens: int, seed: int, split: str):
    """``n`` tasks cycling through the comma-separated families (low,high -> low, high, low, ...)."""
    from rift_ada.data import build_tasks

    fams = [f.strip() for f in families.split(",") if f.strip()]
    per = {f: build_tasks(tokenizer, f, n=-(-n // len(fams)), input_tokens=input_tokens, seed=seed, split=split)
           for f in dict.fromkeys(fams)}
    return [per[fams[i % len(fams)]][i // len(fams)] for i in range(n)]


def _progress(total: int, desc: str):
    from stable_baselines3.common.callbacks import BaseCallback

    class Progress(BaseCallback):
        def _on_training_start(self):
            self.bar = tqdm(total=total, desc=desc)

        def _on_step(self):
            self.bar.update(self.training_env.num_envs)  # callbacks count vector steps
            return True

        def _on_training_end(self):
            self.bar.close()

    return Progress()


def _write_outputs(out: Path, rows, full, summary, timings, args, ctrl_path, best, run, data_stats) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import wandb

    cols = ["family", "knob", "acceptance_length", "al_vs_full", "refreshes_per_1k", "refreshes", "refresh_savings",
            "al_gain"]
    with (out / "tradeoff.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows({c: r.get(c) for c in cols} for r in rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    families = list(dict.fromkeys(r["family"] for r in rows))
    for fam in families:
        pts = sorted((r["refreshes_per_1k"], r["acceptance_length"]) for r in rows if r["family"] == fam)
        ax.plot(*zip(*pts), marker="o", label=fam)
    ax.axhline(full["acceptance_length"], color="grey", ls="--", label="full cache")
    ax.set_xlabel("refreshes per 1K generated tokens")
    ax.set_ylabel("acceptance length (tokens / target step)")
    ax.set_title(f"draft KV budget {args.budget}, {args.input_tokens}-token prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tradeoff.png", dpi=120)
    plt.close(fig)
    metrics = {"full_cache_acceptance_length": full["acceptance_length"], "rows": rows,
               "matched": summary["families"], "timings": timings, "controller": str(ctrl_path),
               "best": {k: best[k] for k in ("family", "knob")}, "counterfactual": data_stats}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))

    table = wandb.Table(columns=cols, data=[[str(r["knob"]) if c == "knob" else r.get(c) for c in cols] for r in rows])
    xs = [[r["refreshes_per_1k"] for r in rows if r["family"] == f] for f in families]
    ys = [[r["acceptance_length"] for r in rows if r["family"] == f] for f in families]
    run.log({"tradeoff/table": table,
             "tradeoff/al_vs_refreshes": wandb.plot.line_series(xs=xs, ys=ys, keys=families,
                                                                title="AL vs refreshes per 1K tokens",
                                                                xname="refreshes per 1K tokens")})
    for fam, s in summary["families"].items():
        run.summary[f"{fam}/refresh_savings_at_matched_al"] = s["refresh_savings"]
        run.summary[f"{fam}/al_gain_at_matched_refreshes"] = s["al_gain"]
    run.summary["full_cache_acceptance_length"] = full["acceptance_length"]


if __name__ == "__main__":  # SB3's SubprocVecEnv (if a user switches to it) uses forkserver: keep this guard
    sys.exit(main())
