"""Options shared by the command-line tools: which prompts to run, where to run them, and clean error exits.

Bad input ends a command with one line on stderr and exit code 2, never a traceback:

    parser = cli.ArgumentParser(...)          # argparse's own errors in one line
    cli.add_runtime_options(parser)           # --device, --dtype, --threads
    args = parser.parse_args(argv)
    try:
        cli.apply_runtime(args)               # checks them, sets torch's thread count
        ...                                   # load models and data, run
    except (ValueError, FileNotFoundError, RuntimeError) as e:   # ModelLoadError is a RuntimeError
        return cli.fail(e)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .data.tasks import TASK_FAMILIES


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with usage errors in one line (argparse prints the whole usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_runtime_options(parser: argparse.ArgumentParser, threads: int = 1) -> None:
    """Declare ``--device``, ``--dtype`` and ``--threads`` (default ``threads``); check them with
    :func:`apply_runtime` after parsing."""
    g = parser.add_argument_group("runtime")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda, cuda:N or mps (default here: %(default)s)")
    g.add_argument("--dtype", default=None,
                   help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--threads", type=int, default=threads,
                   help="torch CPU threads (default: %(default)s). On a 2-core machine 2 threads were 1.1x faster "
                        "decoding (1.6x prefill) when the machine was idle, but 4x slower when another job shared "
                        "it; 1 is the safe default")


def apply_runtime(args) -> None:
    """Check ``args.device`` / ``args.dtype`` / ``args.threads`` (from :func:`add_runtime_options`) and call
    ``torch.set_num_threads``. ``args.dtype`` becomes its canonical name (``bf16`` -> ``bfloat16``). Raises
    ValueError with a one-line message; print it with :func:`fail`."""
    from .models import dtype_name

    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"--device {args.device}: CUDA is not available (torch {torch.__version__} sees no "
                             "GPU); use --device cpu")
        if device.index is not None and device.index >= n:
            raise ValueError(f"--device {args.device}: there are only {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {args.device}: MPS is not available here; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {args.device!r} is not supported; use cpu, cuda, cuda:N or mps")
    if args.dtype is not None:
        try:
            args.dtype = dtype_name(args.dtype)
        except ValueError as e:
            raise ValueError(f"--dtype: {e}") from None
    torch.set_num_threads(args.threads)


def add_model_options(parser: argparse.ArgumentParser, drafter: str = "self", device_map: bool = False) -> None:
    """``--target``, ``--drafter`` and, with ``device_map`` (for commands that pass it on to
    ``rift_ada.models.load_pair``), ``--device-map``."""
    g = parser.add_argument_group("models")
    g.add_argument("--target", default="testbed",
                   help="'testbed' (the shipped target), 'testbed-lm' (its trained model alone, without the "
                        "composed copier), a local HF folder or a hub id")
    g.add_argument("--drafter", default=drafter,
                   help="'self' (the target drafts on a compressed cache), 'testbed' (the shipped draft), "
                        "'testbed-lm' (the trained draft alone), or a local folder / hub id of a draft sharing the "
                        "target's tokenizer (default: %(default)s)")
    if not device_map:
        return
    g.add_argument("--device-map", default=None, choices=["auto", "balanced", "balanced_low_0", "sequential"],
                   help="spread each model's layers over the machine's GPUs with accelerate (models larger than one "
                        "GPU; --device is then ignored for the weights); without GPUs everything stays on the CPU. "
                        "Not under torchrun with several processes")


def add_cache_options(parser: argparse.ArgumentParser, policy: str | None = "rift-stat", budget: int | None = 512,
                      budget_help: str = "active draft KV budget in tokens (default: %(default)s)",
                      refresh_grid: int = 1) -> None:
    """The draft cache: ``--policy`` (omit with ``policy=None``: scripts that sweep policies), the layout's knobs and
    ``--period`` / ``--controller``. :func:`policy_from_args` turns them into a :class:`~rift_ada.policies.CachePolicy`."""
    from .policies import POLICIES
    from .scorers import SCORERS

    g = parser.add_argument_group("draft cache")
    if policy is not None:
        g.add_argument("--policy", default=policy, help=f"one of: {', '.join(POLICIES)} (default: %(default)s)")
        g.add_argument("--period", type=int, default=None, help="rift-dyn: generated tokens between refreshes")
        g.add_argument("--controller", default=None,
                       help="rift-ada: a controller file (controller.json / controller.pt), periodic:N, entropy:X "
                            "(refresh when mean draft entropy / ln vocab exceeds X in [0, 1]) or never")
    g.add_argument("--budget", type=int, default=budget, help=budget_help)
    g.add_argument("--window-fraction", type=float, default=0.5, help="share of the budget for the sliding window")
    g.add_argument("--window", type=int, default=None, help="sliding window in tokens (overrides the fraction)")
    g.add_argument("--sinks", type=int, default=4, help="attention sinks kept by the 'window' policy")
    g.add_argument("--scorer", default="snapkv", help=f"one of: {', '.join(SCORERS)}; or a learned scorer's file "
                   "(PATH.pt: experiments/train_scorer.py)")
    g.add_argument("--obs-window", type=int, default=32, help="observation queries used for scoring")
    g.add_argument("--kernel", type=int, default=7, help="snapkv pooling kernel")
    g.add_argument("--pooling", default="max", help="snapkv pooling: max, avg or none")
    g.add_argument("--lookahead", type=int, default=64,
                   help="extend snapkv scores this many tokens forward (0 = plain SnapKV)")
    g.add_argument("--refresh-grid", type=int, default=refresh_grid,
                   help="a refresh scores the history as of the last multiple of this many generated tokens (1: up "
                        "to now); replay tables hold one row per grid point, so tables and decoder must agree "
                        "(default: %(default)s)")


def policy_from_args(args, name: str | None = None, **overrides):
    """The :class:`~rift_ada.policies.CachePolicy` the cache options describe (``name``/``overrides`` for sweeps)."""
    from .policies import make_policy

    opts = dict(budget=args.budget, window_fraction=args.window_fraction, window=args.window, sinks=args.sinks,
                scorer=args.scorer, obs_window=args.obs_window, lookahead=args.lookahead,
                period=getattr(args, "period", None), controller=getattr(args, "controller", None),
                refresh_grid=getattr(args, "refresh_grid", 1))
    opts.update(overrides)
    if "scorer_options" not in opts:
        opts["scorer_options"] = _snapkv_options(args, opts["scorer"])
    return make_policy(name or args.policy, **opts)


def _snapkv_options(args, scorer: str) -> tuple:
    """--kernel and --pooling for snapkv; for another scorer nothing, and an error if either was changed (a
    setting the scorer would ignore)."""
    from .scorers import SnapKVScorer

    given = (("kernel", args.kernel), ("pooling", args.pooling))
    if scorer == "snapkv":
        return given
    changed = [k for k, v in given if v != SnapKVScorer.__dataclass_fields__[k].default]
    if changed:
        raise ValueError(f"--{' and --'.join(changed)} only appl{'y' if len(changed) > 1 else 'ies'} to --scorer "
                         f"snapkv, not {scorer!r}")
    return ()


STEPS = ("model", "static", "compiled")


def add_decoding_options(parser: argparse.ArgumentParser, max_new_tokens: int = 256) -> None:
    g = parser.add_argument_group("decoding")
    g.add_argument("--draft-length", type=int, default=11, help="draft tokens per round (k)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=_top_k, default=0, help="sample from the k most likely tokens (0 = off)")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="(default: %(default)s)")
    g.add_argument("--draft-step", choices=STEPS, default=None,
                   help="the draft's forward: its own (model, the default), the static-shape step over the RIFT "
                        "cache's fixed buffers (static, rift_ada.static), or that step compiled (compiled)")
    g.add_argument("--verify-step", choices=STEPS, default=None,
                   help="the target's verify: its own forward on its own cache (model, the default), or a fixed "
                        "k + 1 block on a static cache (static), compiled (compiled)")
    g.add_argument("--compile", action="store_true",
                   help="= --draft-step compiled --verify-step compiled (torch.compile; CUDA graphs on GPU). The "
                        "first steps compile: their time is not decode speed")


def _top_k(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0 = off), got {value}")
    return value


def _step(args, name: str) -> str:
    given = getattr(args, name, None)
    return given or ("compiled" if getattr(args, "compile", False) else "model")


def decoding_from_args(args, **overrides):
    """The :class:`~rift_ada.speculative.Decoding` the decoding options (and ``--seed``) describe."""
    from .speculative import Decoding

    opts = dict(draft_length=args.draft_length, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                top_k=getattr(args, "top_k", 0), draft_step=_step(args, "draft_step"),
                verify_step=_step(args, "verify_step"))
    return Decoding(**{**opts, **overrides})


def add_task_options(parser: argparse.ArgumentParser, prompts: int = 12, input_tokens: int = 2048,
                     task: str = "low", several_lengths: bool = False) -> None:
    """The prompt options every command shares; ``several_lengths``: ``--input-tokens`` takes a list (a command that
    measures at each length in turn)."""
    g = parser.add_argument_group("prompts")
    g.add_argument("--prompts", type=int, default=prompts, help="number of prompts")
    if several_lengths:
        g.add_argument("--input-tokens", type=int, nargs="+", default=[input_tokens],
                       help="prompt lengths in tokens (built tasks): one or several, measured in turn")
    else:
        g.add_argument("--input-tokens", type=int, default=input_tokens, help="prompt length in tokens (built tasks)")
    g.add_argument("--task", default=task, help=f"task family: {', '.join(TASK_FAMILIES)}, or a comma-separated mix "
                                                "(low,sort,high: prompts cycle through them)")
    g.add_argument("--source-dir", default=None,
                   help="build tasks from this code base: a folder of Python files or an installed package's name "
                        "(pip) (default: held-out standard library files)")
    g.add_argument("--data", default=None, help="a JSONL file of {'prompt', 'reference'} objects instead of built tasks")
    g.add_argument("--speedbench", default=None, help="a SPEED-Bench .jsonl/.parquet file instead of built tasks")
    g.add_argument("--category", default=None, help="with --speedbench: low_entropy, mixed or high_entropy (or low/high)")
    g.add_argument("--max-input-tokens", type=int, default=None, help="with --speedbench: skip longer prompts")
    g.add_argument("--seed", type=int, default=0, help="seed for task building")


def tasks_from_args(args, tokenizer, require_reference: bool = False):
    from .data.jsonl import load_jsonl
    from .data.tasks import build_tasks

    if args.prompts < 1:
        raise ValueError("--prompts must be >= 1")
    if args.data and args.speedbench:
        raise ValueError("give --data or --speedbench, not both")
    if args.data:
        return load_jsonl(args.data, require_reference=require_reference)[: args.prompts]
    if args.speedbench:
        from .data.speedbench import load_speedbench

        if require_reference:
            raise ValueError("SPEED-Bench rows carry no reference continuation; this command needs --data or built tasks")
        tasks = load_speedbench(args.speedbench, tokenizer, category=args.category, max_tokens=args.max_input_tokens)
        if not tasks:
            raise ValueError(f"no SPEED-Bench prompts left after filtering {args.speedbench!r}")
        return tasks[: args.prompts]
    from .data.sources import source_folder

    source = None if args.source_dir in (None, "stdlib") else source_folder(args.source_dir)
    if "," in args.task:
        from .data.tasks import build_task_mix

        return build_task_mix(tokenizer, args.task, args.prompts, args.input_tokens, args.seed, None,
                              source_dir=source)
    return build_tasks(tokenizer, args.task, n=args.prompts, input_tokens=args.input_tokens, seed=args.seed,
                       source_dir=source)


# --- controllers: their knobs' and training options' spelling on the command line -----------------------------------
def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def option_dest(cls, name: str) -> str:
    """Where the parsed arguments keep a learned kind's training option ``name`` (``--KIND-NAME``)."""
    return f"{cls.kind}_{name}".replace("-", "_")


def add_knob_options(group, **defaults) -> None:
    """Every swept rule kind's knob as an option: ``Knob("periods")`` is ``--periods`` (``rift_ada.sweep``);
    ``defaults`` (by knob name, e.g. ``acc_thresholds=[...]``) replace a kind's own."""
    from .refresh.registry import swept

    for cls in swept():
        if cls.knob.name is not None:
            group.add_argument(_option(cls.knob.name), type=cls.knob.type, nargs="*",
                               default=list(defaults.get(cls.knob.name, cls.knob.default)),
                               help=f"{cls.knob.help} (default: %(default)s; none: leave the kind out)")


def add_learned_options(group) -> None:
    """Every learned kind's knob (``--tree-decisions``, ``--lams``, ...; one option for kinds sharing a knob) and
    training options (``Option`` ``depth`` of kind ``tree``: ``--tree-depth``), and ``--learners``: which optional
    kinds the main job trains."""
    from .refresh.registry import learned

    seen = set()
    for cls in learned():
        if cls.knob.name not in seen:
            seen.add(cls.knob.name)
            nargs = "*" if cls.knob.field else "+"  # a level is chosen when none is given; a training value is not
            group.add_argument(_option(cls.knob.name), type=cls.knob.type, nargs=nargs, default=list(cls.knob.default),
                               help=cls.knob.help)
        for name, opt in cls.options.items():
            group.add_argument(_option(option_dest(cls, name)), type=opt.type, default=opt.default,
                               help=f"{opt.help} (default: %(default)s)")
    optional = [c.kind for c in learned() if c.optional]
    group.add_argument("--learners", default=",".join(optional),
                       help=f"comma-separated learners to train besides {', '.join(c.kind for c in learned() if not c.optional)}: "
                            f"{', '.join(optional)}, or none (default: %(default)s)")


def knob_values(args) -> dict:
    """Each swept rule kind's values as given (``["-"]``: a kind without values, one point): ``rift_ada.sweep``'s
    input."""
    from .refresh.registry import swept

    return {c.kind: ["-"] if c.knob.name is None else list(getattr(args, c.knob.name)) for c in swept()}


def knob_problem(args, kinds=None) -> str | None:
    """What is wrong with a knob option's values (one line), or None; ``kinds``: which (default: the swept rules)."""
    from .refresh.registry import swept

    for cls in swept() if kinds is None else kinds:
        if cls.knob.name is not None:
            problem = cls.knob.problem(getattr(args, cls.knob.name))
            if problem:
                return f"{_option(cls.knob.name)} {problem}"
    return None


def options_problem(args) -> str | None:
    """What is wrong with a learned kind's training option (one line), or None."""
    from .refresh.registry import learned

    for cls in learned():
        for name, opt in cls.options.items():
            value, low = getattr(args, option_dest(cls, name)), opt.low
            if low is not None and (value <= low if opt.open else value < low):
                return f"{_option(option_dest(cls, name))} must be {'>' if opt.open else '>='} {low:g}"
    return None


def learners_of(args) -> list:
    """The learned kinds the main job trains: every non-optional one, and those ``--learners`` names, in registration
    order; ValueError (one line) for a name that is not an optional learned kind."""
    from .refresh.registry import learned

    names = [x.strip() for x in args.learners.split(",") if x.strip()]
    optional = [c.kind for c in learned() if c.optional]
    unknown = [x for x in names if x not in optional + ["none"]]
    if "none" in names and len(names) > 1:
        unknown.append("none together with a learner")
    if unknown or not names:
        raise ValueError(f"--learners: {', '.join(unknown) or 'none given'}; choose among {', '.join(optional)} "
                         "(comma-separated), or none")
    return [c for c in learned() if not c.optional or c.kind in names]


def require_positive(parser: argparse.ArgumentParser, args, names) -> None:
    """``parser.error`` (exit 2; one line with :class:`ArgumentParser`) for any of ``names`` below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def check_output(path: str | None) -> None:
    """ValueError unless ``path`` (an output file option; None = not given) can be written: checked before a long run,
    not after it."""
    if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
        raise ValueError(f"cannot write {path!r}: its folder does not exist")


def write_output(path: str | None, obj) -> None:
    """Write ``obj`` as JSON to ``--output`` when one was given (checked early by :func:`check_output`)."""
    if path:
        Path(path).write_text(json.dumps(obj, indent=1))


def fail_in_group(err: BaseException) -> int:
    """:func:`fail` under torchrun: every process runs the same setup and meets the same bad input, so rank 0 alone
    reports it; an error on one process's own share (``distributed.RankError``) is reported by that process. The
    others exit 2 silently."""
    from . import distributed

    return fail(err) if distributed.is_main() or isinstance(err, distributed.RankError) else 2


def fail(err: BaseException) -> int:
    """Print a one-line error (no traceback for bad input) and return the exit code, 2."""
    print("error: " + " ".join(str(err).split()), file=sys.stderr)  # some library messages span several lines
    return 2
