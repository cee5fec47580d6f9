"""The decode benchmark's controller rows (``experiments/bench_decode.py --controller FILE``): decode-only tokens per
second of plain decoding (``greedy``: the target alone, one token per forward on the static cache, sampling at
T > 0), the best fixed (k, period) chosen on the training prompts (``best_fixed``), the context-length k table
(``length_table``, left out where it is the best fixed setting at every length) and the controller (``joint``), per
input length and task family, each prompt's rows run one after another and repeated in a rotating order in this one
process (a slow spell of the machine falls on every row alike). Beside the measured speed: each row's AL, refreshes,
the k it chose per family, and the speed its cost model predicted for the same rounds (with ``--measure-costs``, the
costs measured here first, which also price the controller's decisions).
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from tqdm.auto import tqdm

from .decode_bench import plain_decode, target_prefill
from ..joint.control import FixedJoint, JointController, baseline, is_joint

ROWS = ("greedy", "best_fixed", "length_table", "joint")


def add_controller_options(parser) -> None:
    g = parser.add_argument_group("controller rows (--controller)")
    g.add_argument("--controller", default=None,
                   help="a controller file: adds greedy, best_fixed, length_table and joint rows per length and task "
                        "family (decode only); the other rows are not run")
    g.add_argument("--task", default="low,sort,high", help="task families, comma-separated (with --controller)")
    g.add_argument("--rows", default=",".join(ROWS),
                   help="the rows to run, comma-separated, joint among them (with --controller; default all: "
                        "e.g. greedy,joint spends a long run on the one comparison)")
    g.add_argument("--source-dir", default=None, help="build prompts from this code base (a folder or an installed "
                   "package's name: pip); default the held-out standard library files")
    g.add_argument("--temperature", type=float, default=1.0, help="with --controller (0: greedy, checked lossless)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--measure-costs", action="store_true",
                   help="before each length's rows, measure this machine's round costs there (a few minutes) and "
                        "price the controller's decisions and every row's modelled speed by them instead of the "
                        "costs in its file")


def check_controller_args(args) -> None:
    """Before any model loads: the task families, the prompt source and (with ``--controller``) the controller, read
    into ``args.families``, ``args.source`` and ``args.controller``. ValueError (one line) for bad ones."""
    from ..data.sources import source_folder
    from ..data.tasks import TASK_FAMILIES

    args.families = [f.strip() for f in args.task.split(",")] if args.controller else ["low"]
    unknown = [f for f in args.families if f not in TASK_FAMILIES]
    if unknown:
        raise ValueError(f"--task: unknown families {', '.join(unknown)}; choose from {', '.join(TASK_FAMILIES)}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    args.source = None if args.source_dir in (None, "stdlib") else source_folder(args.source_dir)
    args.rows = [r.strip() for r in getattr(args, "rows", ",".join(ROWS)).split(",")]
    if "joint" not in args.rows or set(args.rows) - set(ROWS):
        raise ValueError(f"--rows: choose from {', '.join(ROWS)}, joint among them; got {', '.join(args.rows)}")
    if args.controller:
        from ..refresh.loader import load_controller

        path, args.controller = args.controller, load_controller(args.controller)
        rows_of(args.controller)
        args.controller_path = str(path)
        if not getattr(args, "measure_costs", False):
            args.controller.costs.check(where=str(path))


def controller_report(args) -> dict:
    """The head of the report: what was compared, under which costs."""
    c = args.controller
    rows = rows_of(c)
    return {"controller": args.controller_path, "family": c.family, "temperature": args.temperature,
            "source_dir": args.source_dir or "stdlib", "prompts": args.prompts, "repeats": args.repeats,
            "rows": run_rows(c, args.rows),
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "device": args.device,
            **{name: rows[name].describe() for name in ("best_fixed", "length_table") if name in rows},
            **({} if "length_table" in rows or "length_table" not in c.baselines else
               {"length_table": "the best fixed setting at every length (its rows are best_fixed's)"}),
            "costs": "measured at each length (lengths[].costs)" if getattr(args, "measure_costs", False)
            else c.costs.to_dict(), "lengths": []}


@torch.inference_mode()
def rows_of(controller) -> dict[str, JointController]:
    """The rows a controller file gives: a joint controller's recorded baselines and itself; a refresh-only
    controller runs as the joint row at the decoder's k."""
    if not is_joint(controller):
        raise ValueError("--controller needs a joint controller file (train_controller.py --joint writes them)")
    rows = {"best_fixed": baseline(controller.baselines["best_fixed"])} if "best_fixed" in controller.baselines else {}
    if "length_table" in controller.baselines:
        table, fixed = baseline(controller.baselines["length_table"]), rows.get("best_fixed")
        if not same_decisions(table, fixed):  # every length's best k the fixed one's: its rows would repeat them
            rows["length_table"] = table
    return {**rows, "joint": controller}


def run_rows(controller, wanted) -> list[str]:
    """The rows a bench of ``controller`` runs, in order: greedy, then those of :func:`rows_of` in ``wanted``."""
    return [name for name in ("greedy", *rows_of(controller)) if name in wanted]


def same_decisions(table, fixed) -> bool:
    """Whether a length table decides as a fixed setting does at every context (one k everywhere, the same period)."""
    return fixed is not None and set(table.ks) == {fixed.k} and (fixed.k == 0 or table.period == fixed.period)


def bench_controller(pair, controller, prompts_by_family: dict, args) -> dict:
    """One input length: {family: {row: numbers, "ratios": joint over each other row, with intervals}} and "all"
    (every family's tokens over their seconds), "ratios" over all families."""
    from ..speculative import Decoding, SpeculativeDecoder

    costs = controller.costs
    names = run_rows(controller, getattr(args, "rows", ROWS))  # callers may pass a namespace without --rows
    rows = {name: row for name, row in rows_of(controller).items() if name in names}
    steps = costs.steps if costs.steps in ("model", "static", "compiled") else "model"
    layout = controller.cache_layout()
    k = max(r.k_max for r in rows.values())
    eos = pair.tokenizer.eos_token_id
    out, totals, per_repeat = {}, {}, {}
    # One prefill per prompt for every row and repeat (decode alone is timed; at 16K a prefill costs minutes): the
    # target's for plain decoding, both caches' for the speculative rows (copied: reuse_prefill).
    dec = SpeculativeDecoder.for_pair(pair, layout, Decoding(k, args.temperature, seed=args.seed, draft_step=steps,
                                                             verify_step=steps))
    dec.reuse_prefill = True
    measured = getattr(args, "measure_costs", False)
    if measured:
        costs = controller.prices = measure_here(dec, prompts_by_family, sorted({k for _, k in controller.choices}))
    bar = tqdm(total=sum(map(len, prompts_by_family.values())) * args.repeats * len(names),
               desc=f"{len(next(iter(prompts_by_family.values()))[0])}-token prompts")
    for family, prompts in prompts_by_family.items():
        runs = {name: [] for name in names}
        for i, ids in enumerate(prompts):
            prefilled = None  # the last prompt's cache goes before this one's prefill (1.2 GB at 16K)
            prefilled = target_prefill(pair.target, ids) if "greedy" in names else None
            for rep in range(args.repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:  # each row first in turn
                    bar.update()
                    seed = args.seed + 1000 * i + rep
                    if name == "greedy":
                        toks, secs = plain_decode(pair.target, ids, args.max_new_tokens, eos, args.temperature, seed,
                                                  prefilled=prefilled)
                        runs[name].append((toks, secs, [], len(ids)))
                        continue
                    dec.seed = seed
                    dec.reset(ids, args.max_new_tokens)
                    t = time.perf_counter()
                    records = list(dec.rounds(rows[name].act))
                    runs[name].append((dec.result.tokens, time.perf_counter() - t, records, len(ids)))
        out[family] = {name: summarize(r, costs) for name, r in runs.items()}
        if args.temperature == 0 and "greedy" in runs:
            out[family]["same_output"] = {n: [x[0] for x in r] == [x[0] for x in runs["greedy"]]
                                          for n, r in runs.items()}
        for name, r in runs.items():
            tok, sec = totals.get(name, (0, 0.0))
            totals[name] = (tok + sum(len(x[0]) - 1 for x in r), sec + sum(x[1] for x in r))
            # per prompt, per repeat: what the intervals below resample (a prompt and repeat's rows ran side by side)
            per_repeat.setdefault(family, {})[name] = [[(len(x[0]) - 1, x[1]) for x in r[j:j + args.repeats]]
                                                       for j in range(0, len(r), args.repeats)]
        out[family]["ratios"] = ratios(per_repeat, names, args.seed, [family])
    bar.close()
    out["all"] = {name: {"tokens_per_s": tok / sec} for name, (tok, sec) in totals.items()}
    if measured:
        out["costs"] = costs.to_dict()
    out["ratios"] = ratios(per_repeat, names, args.seed)
    return out


def ratios(per_repeat: dict, names, seed: int, families=None) -> dict:
    """The joint row over each other row run (``ratio_interval``), over ``families`` (None: all)."""
    picked = {f: rows for f, rows in per_repeat.items() if families is None or f in families}
    return {f"joint_over_{base}": ratio_interval(picked, "joint", base, seed)
            for base in ("best_fixed", "greedy", "length_table") if base in names}


def measure_here(dec, prompts_by_family: dict, draft_lengths):
    """The round costs of this machine at this length, measured with the bench's own decoder on its first prompt that
    runs long enough without an end-of-text token (rift_ada.joint.costs.measure_round_costs)."""
    from ..joint.costs import measure_round_costs

    for ids in (ids for prompts in prompts_by_family.values() for ids in prompts):
        try:
            return measure_round_costs(dec, {len(ids): ids}, draft_lengths, progress=True)
        except ValueError as e:
            error = e
    raise error


def ratio_interval(per_repeat: dict, row: str, base: str, seed: int = 0, resamples: int = 2000) -> dict:
    """``row``'s tokens/s over ``base``'s across the families given (tokens over seconds, as "all"), and its 95%
    bootstrap interval, resampled at two levels: prompts within each family, then repeats within each prompt picked.
    ``per_repeat``: {family: {row: [[(tokens, seconds) per repeat] per prompt]}}. A prompt's and a repeat's rows stay
    together (they ran side by side: a paired comparison); each row's continuation at T > 0 is its own draw, and a
    repeat its own spell of the machine, so both levels move the ratio."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arr = {f: np.asarray([rows[row], rows[base]], dtype=np.float64) for f, rows in per_repeat.items()}  # (2, P, R, 2)

    def ratio(picks) -> float:
        tok_s = [sum(arr[f][j, p, r, 0].sum() for f, (p, r) in picks.items()) /
                 sum(arr[f][j, p, r, 1].sum() for f, (p, r) in picks.items()) for j in (0, 1)]
        return tok_s[0] / tok_s[1]

    def pick(a, everything=False):
        n_prompts, n_repeats = a.shape[1:3]
        if everything:
            return np.arange(n_prompts)[:, None], np.arange(n_repeats)[None, :]
        prompts = rng.integers(0, n_prompts, n_prompts)
        return prompts[:, None], rng.integers(0, n_repeats, (n_prompts, n_repeats))

    point = ratio({f: pick(a, True) for f, a in arr.items()})
    boot = [ratio({f: pick(a) for f, a in arr.items()}) for _ in range(resamples)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"ratio": point, "interval": [float(lo), float(hi)],
            "prompts_per_family": {f: int(a.shape[1]) for f, a in arr.items()},
            "repeats": int(next(iter(arr.values())).shape[2])}


def summarize(runs: list, costs) -> dict:
    """A row's decode-only tokens/s (the first token comes with the prefill), AL over drafting rounds, refreshes per
    1K tokens, the share of rounds at each k, and the tokens/s its cost model gives for the same rounds (plain
    decoding: one plain step per token)."""
    tokens = sum(len(t) - 1 for t, _, _, _ in runs)
    seconds = sum(s for _, s, _, _ in runs)
    row = {"tokens_per_s": tokens / seconds}
    rounds = [(r, n) for _, _, recs, n in runs for r in recs]
    if not rounds:
        modelled = sum(costs.verify(1, n + i) for t, _, _, n in runs for i in range(1, len(t)))
        return {**row, "modelled_tokens_per_s": tokens / modelled}
    drafting = [r for r, _ in rounds if r.draft_length]
    ks = Counter(r.draft_length for r, _ in rounds)
    modelled = 0.0
    for _, _, recs, n in runs:
        missed = 0  # plain-step tokens since the draft last ran: none after a prefill, which both caches read
        for r in recs:
            modelled += costs.round_seconds(r.draft_length, r.refreshed, n + r.position, missed)
            missed = 0 if r.draft_length else missed + r.emitted
    return {**row, "acceptance_length": sum(r.accepted + 1 for r in drafting) / max(len(drafting), 1),
            "refreshes_per_1k": 1000 * sum(r.refreshed for r, _ in rounds) / tokens,
            "k_share": {int(k): round(n / len(rounds), 4) for k, n in sorted(ks.items())},
            "modelled_tokens_per_s": tokens / modelled}


__all__ = ["ROWS", "FixedJoint", "add_controller_options", "bench_controller", "rows_of"]
