"""The paper's figures in one command: PNGs, one CSV per figure, summary.md and one W&B run.

    python experiments/reproduce_figures.py                 # built-in testbed pair, about 35 minutes on 2 shared CPU cores
    python experiments/reproduce_figures.py --quick         # small settings, 1-2 minutes
    python experiments/reproduce_figures.py --adapter runs/compressibility/adapter \
        --controller runs/controller/controller.pt             # a trained draft and a learned controller, as made by
                                                               # train_compressibility.py and train_controller.py
    torchrun --nproc-per-node 2 experiments/reproduce_figures.py --quick      # prompts sharded across 2 processes

Figures (rift_ada/studies/figures/, one module each, evaluated with ``rift_ada.evaluate.evaluate`` on the same held-out
prompts, as policy_table.py does):

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
   in the rift-stat run, every ``--controller`` given, and with ``--oracle-lams`` the oracle over replay tables
   (rift_ada.replay.oracle, as train_controller.py draws it); the % fewer refreshes than periodic at matched AL comes
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

The paper's headline scale (32K-token inputs, 4K-token outputs, an 8K budget: staleness by position, AL by budget,
retention and the refresh tradeoff, replayed) is ``experiments/paper_regime.py`` (docs/paper-regime.md).

On the built-in testbed (small trained Python LMs; the `testbed` pair's long-range copying is a hand-set circuit)
these figures test the pipeline and the methods' behaviour, not a claim about real LMs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

from rift_ada.studies.figures import FIGURES
from rift_ada.studies.figures.adapter import train_adapter
from rift_ada.studies.figures.evaluations import EvaluationCache, check_positions, default_budget, prompt_sets
from rift_ada.studies.figures.figure import publish, write_summary
from rift_ada import distributed
from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_knob_options,
                          add_model_options, add_runtime_options, add_task_options, apply_runtime, fail_in_group,
                          knob_problem, require_positive)

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
    add_task_options(p, prompts=3, input_tokens=2048, task="low")
    add_cache_options(p, policy=None, budget=None,
                      budget_help="draft KV budget in tokens of figures 1, 3 and 4 (default: 25%% of --input-tokens, "
                                  "or of the mean prompt length with --data / --speedbench)")
    add_decoding_options(p, max_new_tokens=128)
    add_runtime_options(p)
    f = p.add_argument_group("figures")
    f.add_argument("--period", type=int, default=32, help="rift-dyn's refresh period (default: %(default)s)")
    f.add_argument("--controller", dest="controllers", action="append", default=[],
                   help="a controller for rift-ada (figure 1: the first one) and for the tradeoff (figure 4: all): "
                        "a file (controller.json / .pt from train_controller.py), periodic:N or entropy:X; "
                        "repeatable. Default: the threshold rule acc_mean < 0.5")
    f.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25],
                   help="figure 2: budgets as fractions of the input (default: %(default)s)")
    f.add_argument("--input-lengths", type=int, nargs="+", default=[1024, 2048],
                   help="figure 3: prompt lengths in tokens (built tasks; with --data / --speedbench the prompts are "
                        "grouped by length up to each); default: %(default)s")
    # figure 4: every registered controller kind with a knob (--periods, --acc-thresholds, ...)
    add_knob_options(p.add_argument_group("tradeoff sweep (figure 4)"), periods=[16, 64], acc_thresholds=[0.5],
                     entropy_quantiles=[0.9])
    f.add_argument("--oracle-lams", type=float, nargs="*", default=[],
                   help="figure 4: also the oracle (the best schedule over replay tables of the prompts, "
                        "rift_ada.replay) at these refresh prices in target rounds, e.g. 1 4 16 (default: none; the "
                        "tables cost about a decode each per prompt)")
    t = p.add_argument_group("compressibility-trained draft (figures 2 and 5)")
    t.add_argument("--adapter", default=None,
                   help="a LoRA adapter folder from train_compressibility.py (as evaluate's --draft-adapter); "
                        "without it one is trained in <output-dir>/compressibility with the settings below")
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
                               "train_prompts", "train_steps", "continuation_tokens"))
    if any(x < 0 for x in args.oracle_lams):
        p.error("--oracle-lams must be >= 0")
    if args.budget is not None and args.budget < 1:
        p.error("--budget must be >= 1")
    if any(not 0 < b <= 1 for b in args.budgets):
        p.error("--budgets are fractions of the input in (0, 1]")
    if any(n < 1 for n in args.input_lengths):
        p.error("--input-lengths must be >= 1")
    if knob_problem(args):
        p.error(knob_problem(args))
    return args


def main(argv=None) -> int:
    if distributed.is_main():
        args = parse_args(argv)
    else:  # under torchrun rank 0 alone prints --help or a usage error
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parse_args(argv)
    out, run, t_start = Path(args.output_dir), None, time.time()
    try:
        with distributed.leaving():
            check_early(args, out)
            b = load(args)
            adapter = trained_draft(args, out, b)
            if distributed.is_main():
                run = start_wandb(args, out)
                b.costs = measure(b)
            figs = []
            for make in FIGURES:
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


def check_early(args, out: Path) -> None:
    """Options and small files first: bad input fails before models load."""
    from rift_ada.refresh import parse_controller

    apply_runtime(args)
    args.device = distributed.local_device(args.device)
    distributed.init(args.device)
    for spec in args.controllers:
        parse_controller(spec)
    if args.adapter:
        from rift_ada.lora import check_adapter

        check_adapter(args.adapter)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {str(out)!r} is a file")
    if not (args.data or args.speedbench):  # built tasks: the input size is known before the models load
        size = args.input_tokens
        EvaluationCache(args, None, {}, {}, size, args.budget or default_budget(size)).check()
    if distributed.is_main():
        out.mkdir(parents=True, exist_ok=True)
    else:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def load(args) -> EvaluationCache:
    """The pair, the prompt sets and the (so far empty) evaluations, with the untrained draft."""
    from rift_ada.models import load_pair

    pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype, device_map=args.device_map)
    sets, size = prompt_sets(args, pair.tokenizer)
    check_positions(pair, sets, args)
    b = EvaluationCache(args, pair, {"untrained": pair.draft}, sets, size, args.budget or default_budget(size))
    b.check()
    return b


def trained_draft(args, out: Path, b: EvaluationCache) -> str:
    """The trained draft's adapter: given, or trained by rank 0 while the other processes wait; loaded into ``b``."""
    from rift_ada.lora import load_drafter

    adapter, error = args.adapter, None
    if adapter is None and distributed.is_main():
        try:
            trainer = Path(__file__).with_name("train_compressibility.py")
            adapter = str(train_adapter(args, out / "compressibility", trainer))
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            error = str(e)
    if args.adapter is None:  # every process meets here (a collective): rank 0 says how training went
        adapter, error = distributed.gather([(0, (adapter, error))] if distributed.is_main() else [])[0]
        if error:
            raise RuntimeError(error)
    b.drafts["trained"] = load_drafter(b.pair.draft, adapter)
    return adapter


def start_wandb(args, out: Path):
    from rift_ada.trainers.wandb_logging import ResumableRun

    id_file = out / "wandb_run.json"
    id_file.unlink(missing_ok=True)  # a new W&B run for every invocation
    return ResumableRun(id_file, project=args.wandb_project, mode=args.wandb_mode, dir=str(out), config=vars(args),
                        job_type="reproduce_figures")


def measure(b: EvaluationCache):
    """Rank 0: the cost model of figure 4's modelled speeds, measured once on the rift-dyn layout (greedy)."""
    from rift_ada.costs import measure_costs

    decoder = b.decoder(b.policy("rift-dyn").layout, temperature=0.0, top_p=1.0)
    return measure_costs(decoder, b.prompts["main"][0], max(128, b.args.max_new_tokens))


if __name__ == "__main__":
    sys.exit(main())
