"""The paper's figures in one command: PNGs, one CSV per figure, summary.md and one W&B run.

    python experiments/reproduce_figures.py                 # built-in testbed pair, about 21 minutes on 2 CPU cores
    python experiments/reproduce_figures.py --quick         # small settings, 1-2 minutes
    python experiments/reproduce_figures.py --adapter runs/compressibility/adapter \
        --controller runs/controller/controller.pt             # a trained draft and a learned controller, as made by
                                                               # train_compressibility.py and train_controller.py
    torchrun --nproc-per-node 2 experiments/reproduce_figures.py --quick      # prompts sharded across 2 processes

Figures (each evaluated with ``rift_ada.evaluate.evaluate`` on the same held-out prompts, as policy_table.py does):

1. AL by generation quarter for full, window, snapkv, rift-stat, rift-dyn and rift-ada (the rift layout with a
   controller: the first ``--controller`` given, else the acceptance-threshold rule ``acc_mean < 0.5``).
2. AL across budgets (``--budgets``, fractions of the input) for rift-stat and rift-dyn, untrained vs
   compressibility-trained draft (``--adapter DIR``, else a small LoRA trained within the run by
   ``experiments/train_compressibility.py`` in ``<output-dir>/compressibility``, a subprocess), with the full-cache
   AL of both drafts as reference lines.
3. AL across input lengths (``--input-lengths``) at a fixed budget (``--budget``, default 25% of --input-tokens).
4. The refresh tradeoff: AL and tokens/s (measured, and modelled from costs measured once as in
   train_controller.py) versus refreshes per 1K tokens, for periodic refresh at ``--periods``, never (= rift-stat),
   the threshold rule at ``--acc-thresholds``, the entropy rule at ``--entropy-quantiles`` of the draft entropies seen
   in the rift-stat run, every ``--controller`` given, and with ``--oracle-lams`` the hindsight oracle
   (rift_ada/oracle.py, as train_controller.py draws it); the % fewer refreshes than periodic at matched AL comes
   from rift_ada.tradeoff.
5. The training table: figure 2's numbers with the relative change of AL after training.

A setting that two figures share (e.g. rift-stat at 25% is in figures 1, 2, 3 and 4) is evaluated once and reused.
Output (``--output-dir``, default runs/figures): fig1_al_by_quarter.{png,csv}, fig2_al_by_budget.{png,csv},
fig3_al_by_input_length.{png,csv}, fig4_refresh_tradeoff.{png,csv}, fig5_training_table.{png,csv}, summary.md (every
figure as a markdown table), and a W&B run under <output-dir>/wandb (offline by default: ``wandb sync
<output-dir>/wandb/offline-run-*`` uploads it later), each figure logged as a wandb.Image and a wandb.Table.

Under torchrun every process decodes its shard of the prompts (rift_ada.distributed); rank 0 alone measures the
cost model, writes files, logs to W&B and prints. The compressibility training stays single-process: rank 0 runs it
(the other processes wait), then every process loads the adapter.

On the built-in testbed (small trained Python LMs; the `testbed` pair's long-range copying is a hand-set circuit)
these figures test the pipeline and the methods' behaviour, not a claim about real LMs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rift_ada import distributed
from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_model_options,
                          add_runtime_options, add_task_options, apply_runtime, fail_in_group, policy_from_args,
                          require_positive, tasks_from_args)

HERE = Path(__file__).resolve().parent
FIG1_POLICIES = ("full", "window", "snapkv", "rift-stat", "rift-dyn", "rift-ada")
FIG3_POLICIES = ("full", "snapkv", "rift-stat", "rift-dyn", "rift-ada")
VARIANTS = ("rift-stat", "rift-dyn")  # figures 2 and 5
DEFAULT_RULE = ("acc_mean", "<", 0.5)  # rift-ada's controller when no --controller is given
FULL_STYLE = dict(color="black", ls="--", lw=1.5, zorder=3)  # drawn over the policies that match it

# Settings --quick changes (unless given on the command line); the defaults are the parser's.
QUICK = dict(prompts=2, input_tokens=1024, max_new_tokens=64, input_lengths=[768, 1024, 1536], periods=[16, 32, 64],
             acc_thresholds=[0.5, 0.85], entropy_quantiles=[0.5, 0.9], train_prompts=2, train_steps=4,
             continuation_tokens=32)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small settings: " + ", ".join(f"--{k.replace('_', '-')} "
                                                       f"{' '.join(map(str, v)) if isinstance(v, list) else v}"
                                                       for k, v in QUICK.items()))
    add_model_options(p, drafter="testbed", device_map=True)
    add_task_options(p, prompts=6, input_tokens=2048, task="low")
    add_cache_options(p, policy=None, budget=None)
    p._option_string_actions["--budget"].help = ("draft KV budget in tokens of figures 1, 3 and 4 (default: 25%% of "
                                                 "--input-tokens, or of the mean prompt length with --data / "
                                                 "--speedbench)")
    add_decoding_options(p, max_new_tokens=256)
    add_runtime_options(p)
    f = p.add_argument_group("figures")
    f.add_argument("--period", type=int, default=32, help="rift-dyn's refresh period (default: %(default)s)")
    f.add_argument("--controller", dest="controllers", action="append", default=[],
                   help="a controller for rift-ada (figure 1: the first one) and for the tradeoff (figure 4: all): "
                        "a file (controller.json / .pt from train_controller.py), periodic:N or entropy:X; "
                        "repeatable. Default: the threshold rule acc_mean < 0.5")
    f.add_argument("--budgets", type=float, nargs="+", default=[0.0625, 0.125, 0.25, 0.5],
                   help="figure 2: budgets as fractions of the input (default: %(default)s)")
    f.add_argument("--input-lengths", type=int, nargs="+", default=[1024, 2048, 4096],
                   help="figure 3: prompt lengths in tokens (built tasks; with --data / --speedbench the prompts are "
                        "grouped by length up to each); default: %(default)s")
    f.add_argument("--periods", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="figure 4: periodic refresh periods (default: %(default)s)")
    f.add_argument("--acc-thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.85],
                   help="figure 4: threshold rule levels, refresh when acc_mean < x (default: %(default)s)")
    f.add_argument("--entropy-quantiles", type=float, nargs="+", default=[0.5, 0.75, 0.9],
                   help="figure 4: entropy rule levels, at these quantiles of the draft entropies of the rift-stat "
                        "run (default: %(default)s)")
    f.add_argument("--oracle-lams", type=float, nargs="*", default=[],
                   help="figure 4: also the hindsight oracle (rift_ada/oracle.py) at these refresh prices in accepted "
                        "tokens, e.g. 1 4 16 (default: none; each costs about 2 x --oracle-beam decodes per prompt)")
    f.add_argument("--oracle-beam", type=int, default=2, help="oracle: branches kept at each decision")
    f.add_argument("--oracle-block", type=int, default=4, help="oracle: rounds between decisions")
    t = p.add_argument_group("compressibility-trained draft (figures 2 and 5)")
    t.add_argument("--adapter", default=None,
                   help="a LoRA adapter folder from train_compressibility.py (as rift_ada.evaluate --lora); without "
                        "it one is trained in <output-dir>/compressibility with the settings below")
    t.add_argument("--train-prompts", type=int, default=12, help="training prompts (default: %(default)s)")
    t.add_argument("--train-steps", type=int, default=40, help="LoRA steps of 2 samples (default: %(default)s)")
    t.add_argument("--continuation-tokens", type=int, default=128,
                   help="target tokens per training sample (default: %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default="runs/figures")
    o.add_argument("--wandb-project", default="rift-ada")
    o.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    return p


def parse_args(argv=None):
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    known, _ = p.parse_known_args(argv)
    if known.quick:  # --quick changes the defaults; options given on the command line still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    require_positive(p, args, ("prompts", "input_tokens", "max_new_tokens", "draft_length", "period", "threads",
                               "train_prompts", "train_steps", "continuation_tokens", "oracle_beam", "oracle_block"))
    if any(x < 0 for x in args.oracle_lams):
        p.error("--oracle-lams must be >= 0")
    if args.budget is not None and args.budget < 1:
        p.error("--budget must be >= 1")
    if any(not 0 < b <= 1 for b in args.budgets):
        p.error("--budgets are fractions of the input in (0, 1]")
    if any(n < 1 for n in args.input_lengths + args.periods):
        p.error("--input-lengths and --periods must be >= 1")
    if any(not 0 < x < 1 for x in args.acc_thresholds + args.entropy_quantiles):
        p.error("--acc-thresholds and --entropy-quantiles must lie in (0, 1)")
    return args


# --- evaluation, shared by the figures --------------------------------------------------------------------------------
@dataclass
class Bench:
    """The loaded models, prompt sets and evaluations of a run; a setting evaluated once is reused by every figure."""

    args: argparse.Namespace
    pair: object
    drafts: dict  # "untrained" / "trained" -> the draft model (None: self-speculation)
    prompts: dict  # prompt set name -> encoded prompts ("main": figures 1, 2, 4; "len-N": figure 3)
    input_size: int  # the input length budgets are fractions of
    budget: int  # figures 1, 3 and 4
    cache: dict = field(default_factory=dict)
    costs: object = None  # rift_ada.costs.CostModel (rank 0; figure 4)
    _ada: object = None

    def policy(self, name: str, budget: int | None = None, controller=None, period: int | None = None):
        return policy_from_args(self.args, name, budget=self.budget if budget is None else budget,
                                period=(period or self.args.period) if name == "rift-dyn" else None,
                                controller=controller if name == "rift-ada" else None)

    def check(self) -> None:
        """Every figure's cache settings are valid (ValueError otherwise): checked before anything slow."""
        for name in FIG1_POLICIES:
            self.policy(name, controller=self.rift_ada_controller())
        for frac in self.args.budgets:
            self.policy("rift-stat", budget_of(self, frac))

    def rift_ada_controller(self):
        """rift-ada's controller in figures 1, 3 and 4: the first --controller, else the threshold rule (one object,
        so its evaluations are shared)."""
        from rift_ada.refresh import ThresholdController, parse_controller

        if self._ada is None:
            self._ada = parse_controller(self.args.controllers[0]) if self.args.controllers else ThresholdController(
                [DEFAULT_RULE])
        return self._ada

    def evaluate(self, policy, drafter: str = "untrained", prompts: str = "main", label: str = ""):
        """``rift_ada.evaluate.evaluate`` of ``policy`` with one of the drafts on one prompt set (memoised)."""
        from rift_ada.evaluate import evaluate
        from rift_ada.refresh import EntropyController, NeverController, PeriodicController, ThresholdController
        from rift_ada.speculative import SpeculativeDecoder

        ctrl = policy.controller
        rule = isinstance(ctrl, (NeverController, PeriodicController, ThresholdController, EntropyController))
        # the same prompt list (figure 3's set at --input-tokens is the main set), layout and rule: the same run
        key = (drafter, id(self.prompts[prompts]), repr(policy.layout),
               repr(ctrl) if rule or ctrl is None else id(ctrl))
        if key not in self.cache:
            a = self.args
            dec = SpeculativeDecoder(self.pair.target, self.drafts[drafter], policy.layout, a.draft_length,
                                     temperature=a.temperature, top_p=a.top_p,
                                     eos_token_id=self.pair.tokenizer.eos_token_id, seed=a.seed)
            self.cache[key] = evaluate(dec, self.prompts[prompts], ctrl, a.max_new_tokens,
                                       progress=label or policy.name)
        return self.cache[key]


@dataclass
class Figure:
    key: str  # file stem
    title: str
    columns: list  # CSV columns
    rows: list  # dicts
    table: str  # markdown
    draw: Callable  # draws the plot on a matplotlib Axes (figure 4: on the Figure, three panels)
    seconds: float = 0.0


def _pct(budget: int | None, size: int) -> str:
    return "full" if budget is None else f"{budget} ({100 * budget / size:.3g}%)"


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


# --- the figures ----------------------------------------------------------------------------------------------------
def figure_1(b: Bench) -> Figure:
    """AL by generation quarter, every policy."""
    rows = []
    for name in FIG1_POLICIES:
        pol = b.policy(name, controller=b.rift_ada_controller())
        s = b.evaluate(pol, label=f"fig1 {name}").summary
        q = s["acceptance_length_by_quarter"]
        rows.append({"policy": name, "budget": pol.layout.budget, "input_tokens": b.input_size,
                     "acceptance_length": s["acceptance_length"], **{f"al_q{i + 1}": q[i] for i in range(4)},
                     "refreshes": s["refreshes"], "refreshes_per_1k": s["refreshes_per_1k_tokens"],
                     "tokens_per_second": s["tokens_per_second"], "draft_active_kv_bytes": s["draft_active_kv_bytes"],
                     "controller": _ctrl_name(pol.controller)})
    full = rows[0]["acceptance_length"]
    lines = ["| policy | budget | AL | % of full | AL Q1 | AL Q2 | AL Q3 | AL Q4 | refreshes |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['policy']}{' (' + r['controller'] + ')' if r['policy'] == 'rift-ada' else ''} | "
              f"{_pct(r['budget'], b.input_size)} | {r['acceptance_length']:.3f} | "
              f"{100 * r['acceptance_length'] / full:.1f}% | "
              + " | ".join(_f(r[f"al_q{i}"], ".2f") for i in range(1, 5)) + f" | {r['refreshes']} |" for r in rows]

    def draw(ax):
        for r in rows:
            qs = [(i + 1, r[f"al_q{i + 1}"]) for i in range(4) if r[f"al_q{i + 1}"] is not None]
            ax.plot(*zip(*qs), marker="o", label=f"{r['policy']} (AL {r['acceptance_length']:.2f})",
                    **FULL_STYLE if r["policy"] == "full" else {})
        ax.set_xticks([1, 2, 3, 4], ["Q1", "Q2", "Q3", "Q4"])
        ax.set_xlabel("quarter of the generation")
        ax.set_ylabel("acceptance length (tokens / target step)")
        ax.set_title(f"AL across generation position, budget {_pct(b.budget, b.input_size)}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))

    cols = ["policy", "controller", "budget", "input_tokens", "acceptance_length", "al_q1", "al_q2", "al_q3", "al_q4",
            "refreshes", "refreshes_per_1k", "tokens_per_second", "draft_active_kv_bytes"]
    return Figure("fig1_al_by_quarter", "AL across generation position", cols, rows, "\n".join(lines), draw)


def default_budget(input_size: int) -> int:
    return max(2, round(0.25 * input_size))


def budget_of(b: Bench, fraction: float) -> int:
    return max(2, round(fraction * b.input_size))


def figure_2(b: Bench) -> Figure:
    """AL across budgets, untrained vs compressibility-trained draft."""
    rows = []
    for drafter in ("untrained", "trained"):
        s = b.evaluate(b.policy("full"), drafter, label=f"fig2 full {drafter}").summary
        rows.append({"draft": drafter, "policy": "full", "budget_fraction": None, "budget": None,
                     "acceptance_length": s["acceptance_length"], "refreshes": s["refreshes"]})
    for frac in b.args.budgets:
        for name in VARIANTS:
            for drafter in ("untrained", "trained"):
                pol = b.policy(name, budget_of(b, frac))
                s = b.evaluate(pol, drafter, label=f"fig2 {name} {frac:g} {drafter}").summary
                rows.append({"draft": drafter, "policy": name, "budget_fraction": frac, "budget": pol.layout.budget,
                             "acceptance_length": s["acceptance_length"], "refreshes": s["refreshes"]})
    get = {(r["draft"], r["policy"], r["budget_fraction"]): r for r in rows}
    lines = ["| policy | budget | AL untrained | AL trained | refreshes untrained | refreshes trained |",
             "|---|---|---|---|---|---|"]
    for name, frac in [("full", None)] + [(n, f) for f in b.args.budgets for n in VARIANTS]:
        u, t = get["untrained", name, frac], get["trained", name, frac]
        lines.append(f"| {name} | {_pct(u['budget'], b.input_size)} | {u['acceptance_length']:.3f} | "
                     f"{t['acceptance_length']:.3f} | {u['refreshes']} | {t['refreshes']} |")

    def draw(ax):
        import numpy as np

        x = np.arange(len(b.args.budgets))
        width = 0.2
        colors = {"rift-stat": "tab:blue", "rift-dyn": "tab:orange"}
        for j, (name, drafter) in enumerate((n, d) for n in VARIANTS for d in ("untrained", "trained")):
            ys = [get[drafter, name, f]["acceptance_length"] for f in b.args.budgets]
            ax.bar(x + (j - 1.5) * width, ys, width, color=colors[name], edgecolor="black", linewidth=0.5,
                   hatch="//" if drafter == "trained" else None, label=f"{name}, {drafter}")
        for drafter, ls in (("untrained", "--"), ("trained", ":")):
            ax.axhline(get[drafter, "full", None]["acceptance_length"], color="grey", ls=ls,
                       label=f"full cache, {drafter}")
        ax.set_xticks(x, [f"{100 * f:g}%\n({budget_of(b, f)})" for f in b.args.budgets])
        ax.set_xlabel("draft KV budget (% of the input, tokens)")
        ax.set_ylabel("acceptance length")
        ax.set_title("AL across budgets: untrained vs compressibility-trained draft (hatched)", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))

    cols = ["draft", "policy", "budget_fraction", "budget", "acceptance_length", "refreshes"]
    return Figure("fig2_al_by_budget", "AL across budgets, untrained vs trained draft", cols, rows,
                  "\n".join(lines), draw)


def figure_3(b: Bench) -> Figure:
    """AL across input lengths at a fixed budget."""
    rows = []
    for length in b.args.input_lengths:
        name = f"len-{length}"
        if not b.prompts.get(name):
            continue
        mean_len = sum(map(len, b.prompts[name])) / len(b.prompts[name])
        for pol_name in FIG3_POLICIES:
            pol = b.policy(pol_name, controller=b.rift_ada_controller())
            s = b.evaluate(pol, prompts=name, label=f"fig3 {length} {pol_name}").summary
            rows.append({"input_tokens": length, "prompt_tokens_mean": mean_len, "prompts": s["prompts"],
                         "policy": pol_name, "budget": pol.layout.budget, "acceptance_length": s["acceptance_length"],
                         "refreshes": s["refreshes"], "draft_active_kv_bytes": s["draft_active_kv_bytes"]})
    lengths = list(dict.fromkeys(r["input_tokens"] for r in rows))
    get = {(r["input_tokens"], r["policy"]): r for r in rows}
    lines = ["| input tokens (mean prompt) | budget (% of prompt) | " + " | ".join(FIG3_POLICIES) + " |",
             "|---|---|" + "---|" * len(FIG3_POLICIES)]
    lines += [f"| {n} ({get[n, 'full']['prompt_tokens_mean']:.0f}) | "
              f"{b.budget} ({100 * b.budget / get[n, 'full']['prompt_tokens_mean']:.3g}%) | "
              + " | ".join(f"{get[n, p]['acceptance_length']:.3f}" for p in FIG3_POLICIES) + " |" for n in lengths]

    def draw(ax):
        xs = [get[n, "full"]["prompt_tokens_mean"] for n in lengths]  # the prompts' actual mean length
        for p in FIG3_POLICIES:
            ax.plot(xs, [get[n, p]["acceptance_length"] for n in lengths], marker="o", label=p,
                    **FULL_STYLE if p == "full" else {})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("prompt length (tokens, mean over the prompts)")
        ax.set_ylabel("acceptance length")
        ax.set_title(f"AL across input lengths, budget {b.budget} tokens", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))

    cols = ["input_tokens", "prompt_tokens_mean", "prompts", "policy", "budget", "acceptance_length", "refreshes",
            "draft_active_kv_bytes"]
    return Figure("fig3_al_by_input_length", "AL across input lengths at a fixed budget", cols, rows,
                  "\n".join(lines), draw)


def figure_4(b: Bench) -> Figure:
    """The refresh tradeoff: AL and tokens/s versus refreshes, for every controller."""
    import math

    import numpy as np

    from rift_ada import signals
    from rift_ada.refresh import EntropyController, ThresholdController, parse_controller
    from rift_ada.tradeoff import matched_comparison

    a = b.args
    never = b.evaluate(b.policy("rift-stat"), label="fig4 never")  # rift-stat = the rift layout, never refreshed
    ent = np.array([x.entropy_mean for r in never.results for x in r.rounds], dtype=np.float64)
    ent /= math.log(b.pair.target.config.vocab_size)  # the entropy_mean signal's unit
    X = np.zeros((len(ent), len(signals.NAMES)), dtype=np.float32)
    X[:, signals.index("entropy_mean")] = ent
    levels = _experiment("train_controller").entropy_thresholds(X, a.entropy_quantiles) or {}
    points = [("full", "-", b.policy("full")), ("never", "-", b.policy("rift-stat"))]
    points += [("periodic", p, b.policy("rift-dyn", period=p)) for p in a.periods]
    points += [("threshold", x, b.policy("rift-ada", controller=ThresholdController([("acc_mean", "<", x)])))
               for x in a.acc_thresholds]
    points += [("entropy", lvl, b.policy("rift-ada", controller=EntropyController(lvl)))
               for lvl in dict.fromkeys(levels.values())]
    for spec in a.controllers:
        ctrl = b.rift_ada_controller() if spec == a.controllers[0] else parse_controller(spec)
        points.append((getattr(ctrl, "name", "controller"), Path(spec).name, b.policy("rift-ada", controller=ctrl)))
    evs = [b.evaluate(pol, label=f"fig4 {fam} {knob}") for fam, knob, pol in points]
    full = evs[0].summary["acceptance_length"]
    rows = []
    for (fam, knob, _), ev in zip(points, evs):
        s = ev.summary
        modelled = None if fam == "full" or b.costs is None else b.costs.tokens_per_second(ev.results)
        rows.append({"family": fam, "knob": knob, "acceptance_length": s["acceptance_length"],
                     "al_vs_full": s["acceptance_length"] / full, "refreshes_per_1k": s["refreshes_per_1k_tokens"],
                     "refreshes": s["refreshes"], "tokens_per_second": s["tokens_per_second"],
                     "modelled_tokens_per_second": modelled, "refresh_savings": None, "al_gain": None})
    for lam in a.oracle_lams:  # as train_controller.py's oracle points (no measured speed: it decodes forks)
        res = oracle(b, lam)
        tokens, al = sum(r.tokens for r in res), float(np.mean([r.acceptance_length for r in res]))
        modelled = None if b.costs is None else tokens / b.costs.total_seconds(
            sum(r.drafted for r in res), sum(r.rounds for r in res), sum(r.refreshes for r in res))
        rows.append({"family": "oracle", "knob": lam, "acceptance_length": al, "al_vs_full": al / full,
                     "refreshes_per_1k": 1000 * sum(r.refreshes for r in res) / tokens,
                     "refreshes": sum(r.refreshes for r in res), "tokens_per_second": None,
                     "modelled_tokens_per_second": modelled, "refresh_savings": None, "al_gain": None})
    summary = matched_comparison(rows[1:])  # adds refresh_savings / al_gain to the non-periodic rows
    lines = ["| family | knob | AL | AL / full | refreshes per 1K | tok/s measured | tok/s modelled | "
             "fewer refreshes than periodic at matched AL |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['knob'] if isinstance(r['knob'], str) else format(r['knob'], 'g')} | "
              f"{r['acceptance_length']:.3f} | {r['al_vs_full']:.3f} | {r['refreshes_per_1k']:.2f} | "
              f"{_f(r['tokens_per_second'], '.1f')} | {_f(r['modelled_tokens_per_second'], '.1f')} | "
              f"{'-' if r['refresh_savings'] is None else format(100 * r['refresh_savings'], '.1f') + '%'} |"
              for r in rows]
    if b.costs is not None:
        lines.append(f"\nModelled tokens/s (rift_ada.costs, measured once): draft step {1e3 * b.costs.draft_step_s:.2f}"
                     f" ms, verify {1e3 * b.costs.verify_s:.2f} ms, refresh {1e3 * b.costs.refresh_s:.2f} ms.")
    families = list(dict.fromkeys(r["family"] for r in rows[1:]))
    for fam, s in summary["families"].items():
        sav = "n/a" if s["refresh_savings"] is None else f"{100 * s['refresh_savings']:.1f}%"
        lines.append(f"\n{fam}: {sav} fewer refreshes than periodic refresh at matched AL (best knob)")

    def draw(fig):
        axes = fig.subplots(1, 3)
        for ax, key, ylabel in zip(axes, ("acceptance_length", "tokens_per_second", "modelled_tokens_per_second"),
                                   ("acceptance length", "tokens / s (measured)", "tokens / s (modelled)")):
            for fam in families:
                pts = sorted((r["refreshes_per_1k"], r[key]) for r in rows[1:]
                             if r["family"] == fam and r[key] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=fam)
            if rows[0][key] is not None:
                ax.axhline(rows[0][key], color="grey", ls="--", label="full cache")
            ax.set_xlabel("refreshes per 1K generated tokens")
            ax.set_ylabel(ylabel)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"Refresh tradeoff, budget {_pct(b.budget, b.input_size)}", fontsize=9)

    cols = ["family", "knob", "acceptance_length", "al_vs_full", "refreshes_per_1k", "refreshes", "tokens_per_second",
            "modelled_tokens_per_second", "refresh_savings", "al_gain"]
    return Figure("fig4_refresh_tradeoff", "The refresh tradeoff", cols, rows, "\n".join(lines), draw)


def oracle(b: Bench, lam: float) -> list:
    """The hindsight oracle's schedule for every prompt (rift_ada.oracle), sharded under torchrun like evaluate()."""
    from tqdm.auto import tqdm

    from rift_ada.oracle import oracle_schedule
    from rift_ada.speculative import SpeculativeDecoder

    a = b.args
    dec = SpeculativeDecoder(b.pair.target, b.drafts["untrained"], b.policy("rift-dyn").layout, a.draft_length,
                             temperature=a.temperature, top_p=a.top_p, eos_token_id=b.pair.tokenizer.eos_token_id,
                             seed=a.seed)
    mine = []
    for i, ids in tqdm(distributed.shard(b.prompts["main"]), desc=f"fig4 oracle {lam:g}",
                       disable=not distributed.is_main()):
        with distributed.on_shard(i):
            mine.append((i, oracle_schedule(dec, ids, a.max_new_tokens, lam, a.oracle_block, a.oracle_beam)))
    return distributed.gather(mine)


def figure_5(b: Bench, fig2: Figure) -> Figure:
    """The training table: figure 2's numbers with the relative change after compressibility training."""
    get = {(r["draft"], r["policy"], r["budget_fraction"]): r for r in fig2.rows}
    rows = []
    for name, frac in [("full", None)] + [(n, f) for n in VARIANTS for f in b.args.budgets]:
        u, t = get["untrained", name, frac]["acceptance_length"], get["trained", name, frac]["acceptance_length"]
        rows.append({"policy": name, "budget_fraction": frac, "budget": get["untrained", name, frac]["budget"],
                     "al_untrained": u, "al_trained": t, "relative_change": t / u - 1})
    lines = ["| policy | budget | AL untrained | AL trained | change |", "|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {_pct(r['budget'], b.input_size)} | {r['al_untrained']:.3f} | {r['al_trained']:.3f} "
              f"| {100 * r['relative_change']:+.1f}% |" for r in rows]

    def draw(ax):
        labels = [r["policy"] if r["budget"] is None else f"{r['policy']}\n{100 * r['budget_fraction']:g}%"
                  for r in rows]
        ys = [100 * r["relative_change"] for r in rows]
        ax.bar(range(len(rows)), ys, color=["tab:green" if y >= 0 else "tab:red" for y in ys], edgecolor="black",
               linewidth=0.5)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("AL change after compressibility training (%)")
        ax.set_title("Relative change of AL, trained vs untrained draft", fontsize=9)

    cols = ["policy", "budget_fraction", "budget", "al_untrained", "al_trained", "relative_change"]
    return Figure("fig5_training_table", "AL after compressibility training", cols, rows, "\n".join(lines), draw)


# --- plumbing -------------------------------------------------------------------------------------------------------
def _ctrl_name(ctrl) -> str:
    if ctrl is None:
        return ""
    rules = getattr(ctrl, "rules", None)
    if rules:
        return "threshold " + ", ".join(f"{s} {op} {v:g}" for s, op, v in rules)
    return getattr(ctrl, "name", type(ctrl).__name__) + (f" {ctrl.period}" if hasattr(ctrl, "period") else "")


def _experiment(name: str):
    """A sibling script of experiments/ as a module (its functions; its main is not run)."""
    mod = sys.modules.get(f"_rift_experiments.{name}")
    if mod is None:
        spec = importlib.util.spec_from_file_location(f"_rift_experiments.{name}", HERE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def train_adapter(args, folder: Path) -> Path:
    """A small compressibility-trained LoRA adapter: experiments/train_compressibility.py in a subprocess (a single
    process whatever torchrun started; its W&B logging off), its stdout in ``folder/train_compressibility.log``."""
    shutil.rmtree(folder, ignore_errors=True)  # always a fresh training with this run's settings
    folder.mkdir(parents=True)
    argv = ["--target", args.target, "--drafter", args.drafter, "--device", args.device, "--threads",
            str(args.threads), "--output-dir", str(folder), "--train-prompts", str(args.train_prompts),
            "--input-tokens", str(args.input_tokens), "--continuation-tokens", str(args.continuation_tokens),
            "--steps", str(args.train_steps), "--checkpoint-every", str(args.train_steps), "--seed", str(args.seed),
            "--draft-length", str(args.draft_length), "--period", str(args.period), "--wandb-mode", "disabled",
            # its own evaluation table is not used here (figures 2 and 5 are): keep it minimal
            "--eval-prompts", "1", "--eval-new-tokens", "8", "--budgets", "0.25", "--temperatures", "0"]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.device_map:
        argv += ["--device-map", args.device_map]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC")}
    with open(folder / "train_compressibility.log", "w") as log:
        code = subprocess.run([sys.executable, str(HERE / "train_compressibility.py"), *argv], stdout=log,
                              env=env).returncode
    if code != 0:
        raise RuntimeError(f"compressibility training failed (exit {code}; its error is above, its output in "
                           f"{folder / 'train_compressibility.log'}); or pass --adapter DIR")
    return folder / "adapter"


def prompt_sets(args, tokenizer) -> tuple[dict, int]:
    """The prompt sets (encoded) and the input size budgets are fractions of."""
    from rift_ada.data import encode_prompts

    sets = {"main": encode_prompts(tokenizer, tasks_from_args(args, tokenizer))}
    built = not (args.data or args.speedbench)
    size = args.input_tokens if built else round(sum(map(len, sets["main"])) / len(sets["main"]))
    if built:
        for n in args.input_lengths:
            sets[f"len-{n}"] = sets["main"] if n == args.input_tokens else encode_prompts(
                tokenizer, tasks_from_args(argparse.Namespace(**{**vars(args), "input_tokens": n}), tokenizer))
    else:  # prompts from a file: grouped by length, (previous length, n]
        lo = 0
        for n in sorted(args.input_lengths):
            sets[f"len-{n}"] = [p for p in sets["main"] if lo < len(p) <= n]
            lo = n
        if not any(sets[f"len-{n}"] for n in args.input_lengths):
            raise ValueError(f"no prompt is up to {max(args.input_lengths)} tokens long: raise --input-lengths")
    return sets, size


def check_positions(pair, sets: dict, args) -> None:
    limit = min(getattr(m.config, "max_position_embeddings", None) or 10**9 for m in (pair.target, pair.draft))
    for name, prompts in sets.items():
        longest = max(map(len, prompts), default=0)
        if longest + args.max_new_tokens + args.draft_length + 1 > limit:
            what = "--input-lengths" if name.startswith("len-") else "--input-tokens"
            raise ValueError(f"{what}: prompts of up to {longest} tokens + {args.max_new_tokens} new tokens exceed the "
                             f"models' {limit} positions (max_position_embeddings); use shorter prompts")


def publish(fig: Figure, out: Path, run) -> None:
    """Rank 0: the figure's CSV and PNG, and both to W&B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(out / f"{fig.key}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fig.columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(fig.rows)
    wide = fig.key.startswith("fig4")
    mfig = plt.figure(figsize=(13, 4) if wide else (8, 4.5))
    fig.draw(mfig if wide else mfig.add_subplot())
    mfig.tight_layout()
    mfig.savefig(out / f"{fig.key}.png", dpi=110, bbox_inches="tight")  # legends outside the axes included
    plt.close(mfig)
    if run is not None:
        import wandb

        data = [[r.get(c) if c != "knob" else str(r.get(c)) for c in fig.columns] for r in fig.rows]
        run.log({f"{fig.key}/image": wandb.Image(str(out / f"{fig.key}.png")),
                 f"{fig.key}/table": wandb.Table(columns=fig.columns, data=data)})
        run.summary[f"{fig.key}/seconds"] = fig.seconds


def write_summary(out: Path, figs: list, b: Bench, adapter: str, total_s: float) -> None:
    a = b.args
    head = [f"# Figures ({'--quick, ' if a.quick else ''}target {a.target}, drafter {a.drafter})", "",
            "The built-in testbed is a pair of small trained Python LMs (`testbed`: with a hand-set long-range "
            "copier composed beside them): these figures test the pipeline and the methods' behaviour, not a claim "
            "about real LMs." if a.target.startswith("testbed") else "", "",
            f"{len(b.prompts['main'])} held-out prompts ({a.task if not (a.data or a.speedbench) else 'from file'}, "
            f"{b.input_size} tokens), {a.max_new_tokens} new tokens, k = {a.draft_length}, temperature "
            f"{a.temperature:g}, seed {a.seed}; budget {b.budget} tokens in figures 1, 3 and 4; rift-dyn period "
            f"{a.period}; rift-ada: {_ctrl_name(b.rift_ada_controller())}; trained draft: {adapter}. Wall time "
            f"{total_s / 60:.1f} min ({distributed.world_size()} process(es), {a.threads} thread(s) each)."]
    body = []
    for i, f in enumerate(figs, 1):
        body += ["", f"## {i}. {f.title}", "", f"![{f.title}]({f.key}.png)", "", f.table, "",
                 f"({f.key}.csv; {f.seconds:.0f} s)"]
    (out / "summary.md").write_text("\n".join(head + body) + "\n")


def main(argv=None) -> int:
    if distributed.is_main():
        args = parse_args(argv)
    else:  # under torchrun rank 0 alone prints --help or a usage error
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parse_args(argv)
    out, run, t_start = Path(args.output_dir), None, time.time()
    try:
        with distributed.leaving():
            apply_runtime(args)
            args.device = distributed.local_device(args.device)
            distributed.init(args.device)
            # options and small files first: bad input fails before models load
            from rift_ada.refresh import parse_controller

            for spec in args.controllers:
                parse_controller(spec)
            if args.adapter:
                from rift_ada.lora import check_adapter

                check_adapter(args.adapter)
            if out.exists() and not out.is_dir():
                raise ValueError(f"--output-dir {str(out)!r} is a file")
            if not (args.data or args.speedbench):  # built tasks: the input size is known before the models load
                size = args.input_tokens
                Bench(args, None, {}, {}, size, args.budget or default_budget(size)).check()
            if distributed.is_main():
                out.mkdir(parents=True, exist_ok=True)
            if not distributed.is_main():
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            from rift_ada.costs import measure_costs
            from rift_ada.lora import load_drafter
            from rift_ada.models import load_pair
            from rift_ada.speculative import SpeculativeDecoder

            pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype,
                             device_map=args.device_map)
            sets, size = prompt_sets(args, pair.tokenizer)
            check_positions(pair, sets, args)
            budget = args.budget or default_budget(size)
            draft = None if pair.self_speculative else pair.draft
            b = Bench(args, pair, {"untrained": draft}, sets, size, budget)
            b.check()

            # The trained draft: given, or trained by rank 0 while the other processes wait.
            adapter, error = args.adapter, None
            if adapter is None and distributed.is_main():
                try:
                    adapter = str(train_adapter(args, out / "compressibility"))
                except (ValueError, FileNotFoundError, RuntimeError) as e:
                    error = str(e)
            if args.adapter is None:  # every process meets here (a collective): rank 0 says how training went
                adapter, error = distributed.gather([(0, (adapter, error))] if distributed.is_main() else [])[0]
                if error:
                    raise RuntimeError(error)
            b.drafts["trained"] = load_drafter(pair.draft, adapter)

            if distributed.is_main():
                from rift_ada.trainers.wandb_logging import ResumableRun

                id_file = out / "wandb_run.json"
                id_file.unlink(missing_ok=True)  # a new W&B run for every invocation
                run = ResumableRun(id_file, project=args.wandb_project, mode=args.wandb_mode, dir=str(out),
                                   config=vars(args), job_type="reproduce_figures")
                b.costs = measure_costs(SpeculativeDecoder(pair.target, draft, b.policy("rift-dyn").layout,
                                                           args.draft_length, eos_token_id=pair.tokenizer.eos_token_id,
                                                           seed=args.seed),
                                        sets["main"][0], max(128, args.max_new_tokens))

            figs = []
            for make in (figure_1, figure_2, figure_3, figure_4, lambda b: figure_5(b, figs[1])):
                t0 = time.time()
                fig = make(b)
                fig.seconds = time.time() - t0
                figs.append(fig)
                if distributed.is_main():
                    publish(fig, out, run)
            total = time.time() - t_start
            if distributed.is_main():
                write_summary(out, figs, b, adapter, total)
                run.summary["total_seconds"] = total
                run.finish()
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # ModelLoadError is a RuntimeError
        if run is not None:
            run.run.finish(exit_code=2)
        return fail_in_group(e)
    if distributed.is_main():
        print((out / "summary.md").read_text())
        print(f"wrote {out} in {total / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
