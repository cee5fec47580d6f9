"""The main job's stages. Every unit is deterministic given its inputs (seeded tables, replays, fits and decoders) and
returns what its state file holds, so resumed and uninterrupted runs go on with identical values."""

from __future__ import annotations

import sys
from dataclasses import replace

from tqdm.auto import tqdm

from rift_ada import sweep
from rift_ada.sweep import Point

def add_oracle_options(group) -> None:
    group.add_argument("--oracle-lams", type=float, nargs="*", default=[1.0, 2.0, 4.0, 8.0, 16.0],
                       help="the oracle (exact over the held-out tables' grid) at these refresh prices in target "
                            "rounds: its curve shows the saving a controller could reach (none: skip it)")
    group.add_argument("--oracle-episodes", type=int, default=16,
                       help="replays per held-out table of every replayed point (sampling)")


def load(args):
    """The pair, the training prompts (``--prompts-per-source`` from each of ``--train-sources``, the --task families
    cycling) as (code base, ids) and the held-out prompts of ``--source-dir`` (a code base never trained on)."""
    from rift_ada.data import build_task_mix, encode
    from rift_ada.data.sources import build_source_mix, source_folder
    from rift_ada.models import check_fits, load_pair

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
    from rift_ada.replay.build import TableSpec, build_tables

    t0 = time.time()
    builder = table_builder(args, layout, decoding, args.max_new_tokens)
    seeds = args.eval_seeds if decoding.temperature > 0 else 1
    # The held-out tables first: they hold the long generations, and a worker left alone at the end costs least
    # on a short one.
    held = [TableSpec(f"heldout-{i:03d}-{s}", tuple(ids), decoding.seed + s)
            for i, ids in enumerate(evals) for s in range(seeds)]
    paths = build_tables(builder, held, out / "tables", pair, args.workers, progress="held-out tables")
    short = replace(builder, max_new_tokens=min(args.train_new_tokens, args.max_new_tokens))
    specs = training_specs("train", [ids for _, ids in train], args, decoding)
    train_paths = build_tables(short, specs, out / "tables", pair, args.workers, progress="training tables")
    return ([ReplayTable.load(p) for p in train_paths], [ReplayTable.load(p) for p in paths], time.time() - t0)


def table_builder(args, layout, decoding, max_new_tokens: int):
    """The tables' ``Builder``: the pair by name, the layout, and eager model steps (a table is one teacher-forced
    pass, not a timed decode)."""
    from rift_ada.replay.build import Builder

    return Builder(args.target, args.drafter, layout, replace(decoding, draft_step="model", verify_step="model"),
                   max_new_tokens, args.device, args.dtype, args.threads)


def training_specs(prefix: str, prompts: list, args, decoding) -> list:
    """``--tables-per-prompt`` sampled continuations per training prompt (one when greedy), named
    ``<prefix>-<i>-<s>``, each with its own sampling seed."""
    from rift_ada.replay.build import TableSpec

    per = args.tables_per_prompt if decoding.temperature > 0 else 1
    return [TableSpec(f"{prefix}-{i:03d}-{s}", tuple(ids), decoding.seed + 1000 * i + s)
            for i, ids in enumerate(prompts) for s in range(per)]


def train(job, kinds) -> dict:
    """Each learned kind in ``kinds`` trained on ``job`` (``Controller.train``: its units in the job's state):
    kind -> [(knob value, controller), ...], in the order of ``kinds``."""
    return {cls.kind: cls.train(job) for cls in kinds}


def sweep_points(values: dict, observed, trained: dict) -> list[Point]:
    """The real decoder's points: every swept rule kind at its ``values`` (``rift_ada.sweep.rule_points``; quantile
    knobs take their levels in the ``observed`` states), then each learned kind's ``trained`` points."""
    for kind in sweep.unobserved(observed):
        print(f"warning: no states to take quantiles from; skipping the {kind} rule", file=sys.stderr)
    points = sweep.rule_points(values, observed)
    return points + [Point(kind, knob, ctrl, sweep.unit_name(kind, knob))
                     for kind, pts in trained.items() for knob, ctrl in pts]


def check_points(points: list[Point], args) -> list[Point]:
    """The points the real decoder checks the replay on: periodic at --check-periods and the --check-learners
    kinds' points (none without --check-prompts)."""
    if args.check_prompts == 0:
        return []
    from rift_ada.refresh.registry import learned
    from rift_ada.refresh.rules import PeriodicController

    kinds = ({cls.kind for cls in learned()} if args.check_learners == "all"
             else set(args.check_learners.split(",")))
    return ([Point("periodic", p, PeriodicController(p), sweep.unit_name("periodic", p)) for p in args.check_periods]
            + [p for p in points if p.family in kinds])


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
    """One unit per point on ``prompts`` in the real decoder: its counts over --eval-seeds seeds (the same decoder
    seeds at every point: paired)."""
    from .workers import run_units

    units = [(p.unit, sweep_unit, (p, layout, prompts, args.max_new_tokens, args.eval_seeds)) for p in points]
    # The slowest points first (never refreshing decodes the most rounds), so no worker is left with one at the end.
    slow = [p.unit for p in points if p.family == "never"]
    return run_units(state, units, ctx, setting, args.workers, "real-decoder check", first=slow)
