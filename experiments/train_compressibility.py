"""Train a draft to tolerate RIFT compression: LoRA distillation under the sparse attention it meets at inference.

    python experiments/train_compressibility.py --source-dir DIR     # testbed draft; DIR: code the models never saw
    python experiments/train_compressibility.py --self --target testbed-lm   # the target as its own drafter

1. Target outputs (continuations + top-k log-probabilities) for training prompts of every task format (low, sort,
   mixed, high, or --train-tasks; the standard library's training split), stored in <output-dir>/targets (reused
   when present; see trainers/compressibility.py for the format).
2. LoRA training (peft) of the drafter: a frozen dense pass picks importance positions with the inference scorer,
   a masked pass learns the acceptance-aware loss (KL(target || draft) weighted towards rejected positions, plus
   the rejection probability) on the continuation; each sample draws its budget from --budgets (fractions of the
   prompt) or trains on the full cache (--dense-share); RIFT-stat and RIFT-dyn masks are mixed. By default LoRA
   adapts the last layer's values, output and MLP (--lora-layers, --lora-modules): the draft's queries and keys stay
   as they were, so it selects at inference what training masked with. Checkpoints every --checkpoint-every steps.
   Every --eval-every steps, held-out acceptance lengths (full cache, rift-stat at --eval-budgets) go to W&B.
   --self: the target drafts for itself, its adapter in its own weights, on in the drafting passes only.
3. The adapter goes to <output-dir>/adapter (``python -m rift_ada.evaluate ... --draft-adapter <output-dir>/adapter``).
4. The table: AL of the untrained and the trained drafter, full cache, rift-stat and rift-dyn at --eval-budgets, at
   --temperatures, on the standard library's eval split and on --source-dir; results.json holds it with the
   training history and the in-run curve.

Resuming: rerunning the same command continues where a run stopped, even after a kill: the target outputs from
the last finished prompt, training from the latest checkpoint (bit-identical to an uninterrupted run), the table
from its last finished row (rows in <output-dir>/state). The W&B run resumes under the same id. A rerun with other
training settings is refused (exit 2); --no-resume starts over (the target outputs are kept when they match).

Data parallel: ``torchrun --nproc-per-node N ... --grad-accum G`` (G a multiple of N): docs/compressibility.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import time
import warnings
from pathlib import Path

from rift_ada import distributed
from rift_ada.data.tasks import TASK_FAMILIES
from rift_ada.cli import (ArgumentParser, add_model_options, add_runtime_options, apply_runtime, fail_in_group,
                          require_positive)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed", device_map=True)
    p.add_argument("--self", action="store_true",
                   help="self-speculation: the target drafts for itself (as --drafter self), with the adapter on in "
                        "its drafting passes only")
    add_runtime_options(p)
    m = p.add_argument_group("data")
    m.add_argument("--train-prompts", type=int, default=32)
    m.add_argument("--train-tasks", nargs="+", choices=TASK_FAMILIES, help="training task families (default: all four)")
    m.add_argument("--input-tokens", type=int, default=2048, help="prompt length of training and eval prompts")
    m.add_argument("--continuation-tokens", type=int, default=128, help="target tokens per training sample")
    m.add_argument("--top-k", type=int, default=32, help="target log-probabilities stored per position")
    m.add_argument("--target-temperature", type=float, default=0.0, help="0: greedy target continuations")
    m.add_argument("--targets", default=None, help="target-output folder (default <output-dir>/targets)")
    m.add_argument("--build-targets-only", action="store_true", help="store the target outputs and stop")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--grad-accum", type=int, default=2)
    t.add_argument("--budgets", type=float, nargs="+", default=[0.0625, 0.125, 0.25, 0.5],
                   help="training budgets as fractions of the prompt, one drawn per sample (the multi-budget recipe)")
    t.add_argument("--dense-share", type=float, default=0.25,
                   help="share of samples trained on the full cache (keeps the full-cache acceptance)")
    t.add_argument("--accept-weight", type=float, default=4.0,
                   help="acceptance-aware loss: KL weight 1 + this x (1 - acceptance probability) per position")
    t.add_argument("--tv-weight", type=float, default=1.0,
                   help="weight of the rejection probability 1 - sum(min(p, q)) in the loss")
    t.add_argument("--window-fraction", type=float, default=0.5)
    t.add_argument("--period", type=int, default=32, help="RIFT-dyn re-selection period (training and eval)")
    t.add_argument("--dyn-share", type=float, default=0.25, help="share of compressed samples with RIFT-dyn masks")
    t.add_argument("--hindsight-share", type=float, default=0.0, help="share of compressed samples in hindsight masks")
    t.add_argument("--lora-rank", type=int, default=8)
    t.add_argument("--lora-modules", nargs="+", default=list(SELECTION_PRESERVING),
                   help="module names to adapt (default: %(default)s, not q_proj / k_proj: see --lora-layers); 'all': "
                        "every linear layer (rift_ada.lora.DEFAULT_TARGET_MODULES)")
    t.add_argument("--lora-layers", nargs="+", default=["-1"],
                   help="decoder layers to adapt (default: -1, the last), or 'all'. The last layer's values, output "
                        "and MLP leave every query and key the draft scores with unchanged, so the adapted draft selects "
                        "at inference exactly what training masked with (the frozen pass), and its full cache is "
                        "touched only at the output")
    t.add_argument("--checkpoint-every", type=int, default=25)
    t.add_argument("--no-resume", action="store_true",
                   help="start over: delete the checkpoints and state (table rows, W&B run id) in --output-dir")
    t.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # simulates an interruption
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts per table row and prompt set")
    e.add_argument("--eval-task", default="low", help="task family of the held-out prompts")
    e.add_argument("--eval-new-tokens", type=int, default=128)
    e.add_argument("--eval-budgets", type=float, nargs="+", default=[0.125, 0.25],
                   help="budgets of the table and the in-run curves, as fractions of the input")
    e.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    e.add_argument("--source-dir", default=None,
                   help="also evaluate on tasks built from this folder of Python files (a code base the models never "
                        "saw); the in-run curves use it when given")
    e.add_argument("--eval-every", type=int, default=50,
                   help="held-out acceptance lengths during training every this many steps (0: off)")
    e.add_argument("--curve-prompts", type=int, default=2, help="held-out prompts per in-run evaluation")
    e.add_argument("--curve-temperature", type=float, default=1.0, help="temperature of the in-run evaluation")
    e.add_argument("--draft-length", type=int, default=11)
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default="runs/compressibility")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--wandb-project", default="rift-ada")
    o.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    if distributed.is_main():
        return _checked(p, argv)
    # Under torchrun every process parses the same options: rank 0 alone prints --help or a usage error.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return _checked(p, argv)


def _checked(p, argv):
    args = p.parse_args(argv)
    from rift_ada.trainers.compressibility import option_problem

    if problem := option_problem(args, p.get_default("drafter")):
        p.error(problem)
    if args.self:
        args.drafter = "self"
    if args.lora_layers == ["all"]:
        args.lora_layers = None
    else:
        try:
            args.lora_layers = [int(x) for x in args.lora_layers]
        except ValueError:
            p.error(f"--lora-layers takes layer indices or 'all', got {' '.join(args.lora_layers)}")
    if args.lora_modules == ["all"]:
        args.lora_modules = None
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0 (0: no in-run evaluation)")
    require_positive(p, args, ("steps", "grad_accum", "train_prompts", "eval_prompts", "continuation_tokens", "top_k",
                               "period", "checkpoint_every", "lora_rank", "eval_new_tokens", "threads", "curve_prompts"))
    return args


# LoRA targets that change no query or key of the adapted layer (with --lora-layers -1: of any layer).
SELECTION_PRESERVING = ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Options that change neither the target outputs nor training (evaluation options are checked per table row).
SESSION_OPTIONS = ("output_dir", "no_resume", "stop_after", "checkpoint_every", "threads", "wandb_project",
                   "wandb_mode", "build_targets_only")
EVAL_OPTIONS = ("eval_task", "eval_prompts", "eval_new_tokens", "eval_budgets", "temperatures", "draft_length", "source_dir")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        with distributed.leaving():
            apply_runtime(args)
            # Under torchrun: this process's device (cuda -> cuda:LOCAL_RANK) and the process group; no-ops otherwise.
            # (args.device stays as given: it is part of the run's settings, which a resume compares.)
            device = distributed.local_device(args.device)
            world = distributed.init(device)
            if args.grad_accum % world:
                raise ValueError(f"--grad-accum {args.grad_accum} (samples per optimizer step, the global batch) is "
                                 f"not a multiple of the {world} torchrun processes: use a multiple of {world}")
            if not distributed.is_main():  # rank 0 alone prints: the others' library progress bars and warnings too
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
                warnings.simplefilter("ignore")
            code = _main(args, device)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail_in_group(e)
    return code


def _main(args, device: str) -> int:
    from rift_ada.models import load_pair
    from rift_ada.resume import RunState, config_of
    from rift_ada.trainers import compressibility as C
    from rift_ada.trainers import compressibility_eval as E
    from rift_ada.trainers.wandb_logging import ResumableRun

    main, out, t_start = distributed.is_main(), Path(args.output_dir), time.time()
    if args.no_resume and main:
        for folder in ("checkpoints", "state"):
            shutil.rmtree(out / folder, ignore_errors=True)
    # Under torchrun rank 0 alone reads and writes the state; the others learn its answers (and stop on a refusal).
    state = RunState(out / "state", collective=True)
    config = config_of(args, SESSION_OPTIONS + EVAL_OPTIONS)
    if not args.build_targets_only:  # targets alone fix no training settings
        state.check_config(config, "pass --no-resume to start over with these settings, or another --output-dir")
    pair = load_pair(args.target, args.drafter, device=device, dtype=args.dtype, device_map=args.device_map)
    targets = Path(args.targets) if args.targets else out / "targets"
    samples = C.target_outputs(pair, targets, bool(args.targets), args.target, args.train_prompts, args.input_tokens,
                               args.continuation_tokens, args.top_k, args.target_temperature, args.seed,
                               tuple(args.train_tasks or C.TRAIN_FAMILIES))
    if args.build_targets_only:
        if main:
            print(f"target outputs: {len(samples)} samples in {targets}")
        return 0

    run = None
    if main:  # one W&B run, rank 0's
        run = ResumableRun(state.path("wandb.json"), project=args.wandb_project, mode=args.wandb_mode, dir=str(out),
                           config=config, job_type="train_compressibility")
        run.define_metric("lora/*", step_metric="lora/step")
        run.define_metric("heldout/*", step_metric="lora/step")
    held = E.HeldOut(task=args.eval_task, prompts=args.eval_prompts, input_tokens=args.input_tokens,
                     new_tokens=args.eval_new_tokens, draft_length=args.draft_length, period=args.period,
                     budgets=tuple(args.eval_budgets), temperatures=tuple(args.temperatures), seed=args.seed)
    # Held-out prompts: the standard library's eval split, and a code base the models never saw (--source-dir).
    eval_sets = {"stdlib-eval": E.eval_prompts(pair.tokenizer, held)}
    if args.source_dir:
        eval_sets["unseen"] = E.eval_prompts(pair.tokenizer, held, args.source_dir)
    curve_set = "unseen" if args.source_dir else "stdlib-eval"
    curve_ids = eval_sets[curve_set][:args.curve_prompts]  # the in-run curve's (every --eval-every steps)
    curve = lambda model: E.curve_point(pair, model, curve_ids, held, args.curve_temperature)  # noqa: E731
    cfg = C.TrainConfig(steps=args.steps, lr=args.lr, grad_accum=args.grad_accum, budgets=tuple(args.budgets),
                        dense_share=args.dense_share, accept_weight=args.accept_weight, tv_weight=args.tv_weight,
                        window_fraction=args.window_fraction, period=args.period, dyn_share=args.dyn_share,
                        hindsight_share=args.hindsight_share, checkpoint_every=args.checkpoint_every, seed=args.seed)
    t0 = time.time()
    # An external drafter's adapter trains on a copy; a self-drafter's goes into the target, off wherever it verifies.
    student, trained = C.train_adapter(pair.draft, samples, cfg, out, args.lora_rank, args.lora_modules,
                                       args.lora_layers, in_place=pair.self_speculative, resume=not args.no_resume,
                                       log=run.log if run else None, stop_after=args.stop_after, eval_fn=curve,
                                       eval_every=args.eval_every)
    train_s = time.time() - t0
    if args.stop_after is not None and trained["steps_done"] < args.steps:
        if main:
            print(f"stopped after step {trained['steps_done']} (checkpoint saved); rerun to resume", file=sys.stderr)
            run.finish()
        return 0

    # The table: untrained vs trained drafter on held-out prompts, same prompts and seeds; one state unit per row.
    # Under torchrun every process evaluates its share of the prompts of every row (evaluate() gathers).
    drafters = {"untrained": E.eval_drafter(pair.draft), "trained": E.eval_drafter(student, pair.target)}
    rows = [r for name, ids in eval_sets.items() for r in E.evaluate_table(pair, drafters, ids, held, state, name)]
    if not main:
        return 0
    results = {"rows": rows, "train_seconds": train_s, "total_seconds": time.time() - t_start,
               "final_loss": trained["history"][-1]["loss"] if trained["history"] else None,
               "history": trained["history"], "curve": {"prompts": curve_set, "points": trained["evals"]},
               "samples": len(samples), "target_outputs": str(targets), "adapter": str(out / "adapter")}
    print(E.write_results(out, results, run))
    print(f"\nadapter: {out / 'adapter'} | training {train_s:.0f} s | total {results['total_seconds']:.0f} s "
          "(this session)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
