"""What a round costs in seconds as a function of what it does and where: measured once per machine and model pair.

A round that drafts k tokens at context length L (prompt + generated) and refreshes or not costs

    k * draft_s(L) + verify_s(k + 1, L) + refresh_s(L) * [refreshed] + catch_up_s(m, L) * [k > 0]

(k = 0 is a plain target step: verify_s(1, L); m the tokens plain steps emitted since the draft last ran, which it
reads before it drafts). ``measure_round_costs`` runs real rounds of the decoder at a few
context lengths and draft lengths and keeps the medians of their phase times; between measured points the model
interpolates linearly (and extends the last segment's line beyond them). The machine it was measured on is stored
with it: a controller that learned one machine's costs says so when it runs on another (:meth:`RoundCosts.check`).
"""

from __future__ import annotations

import math
import platform
import warnings
from dataclasses import asdict, dataclass, field
from statistics import median

import numpy as np
import torch


def machine() -> dict:
    """What a round's costs depend on besides the models: processor, threads, accelerator, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    # str: torch.__version__ is a TorchVersion, which a controller file (plain values only) would refuse to load
    return {"cpu": cpu, "threads": torch.get_num_threads(), "gpu": gpu, "torch": str(torch.__version__)}


@dataclass(frozen=True)
class RoundCosts:
    lengths: tuple[int, ...]  # context lengths measured (tokens)
    blocks: tuple[int, ...]  # verify widths measured (k + 1)
    verify_s: tuple[tuple[float, ...], ...]  # [length][block]: the target's verify and both caches' rollback
    draft_s: tuple[float, ...]  # [length]: one draft token on the compressed cache
    refresh_s: tuple[float, ...]  # [length]: one rescoring of the draft cache
    budget: int  # the draft cache's budget they were measured at
    steps: str = "model"  # the draft and verify steps they were measured with ("model", "static", "compiled")
    machine: dict = field(default_factory=machine)
    missed: tuple[int, ...] = ()  # plain-step tokens a drafting round's catch-up was measured after
    catch_up_s: tuple[tuple[float, ...], ...] = ()  # [length][missed]: the draft's extra seconds to read them

    def __post_init__(self):
        lengths, blocks = list(self.lengths), list(self.blocks)
        if len(lengths) < 1 or lengths != sorted(set(lengths)) or len(blocks) < 2 or blocks != sorted(set(blocks)):
            raise ValueError(f"RoundCosts: lengths and blocks must be increasing (>= 1 length, >= 2 blocks), got "
                             f"{lengths} and {blocks}")
        if list(self.missed) != sorted(set(self.missed)) or any(m < 1 for m in self.missed):
            raise ValueError(f"RoundCosts: missed must be increasing counts >= 1, got {list(self.missed)}")
        grid = np.asarray(self.verify_s, dtype=np.float64)
        for name, x, shape in (("verify_s", grid, (len(lengths), len(blocks))),
                               ("draft_s", np.asarray(self.draft_s, dtype=np.float64), (len(lengths),)),
                               ("refresh_s", np.asarray(self.refresh_s, dtype=np.float64), (len(lengths),)),
                               ("catch_up_s", np.asarray(self.catch_up_s, dtype=np.float64).reshape(
                                   len(self.catch_up_s), -1 if self.catch_up_s else 0),
                                (len(lengths) if self.missed else 0, len(self.missed)))):
            if x.shape != shape or not np.isfinite(x).all() or (x < 0).any():
                raise ValueError(f"RoundCosts.{name} must hold {shape} finite seconds >= 0, got shape {x.shape}")

    # --- the model -----------------------------------------------------------------------------------------------
    def verify(self, q: int, context: float) -> float:
        by_length = [_line(self.blocks, row, q) for row in self.verify_s]
        return max(_line(self.lengths, by_length, context), 1e-6)

    def draft(self, context: float) -> float:
        return max(_line(self.lengths, self.draft_s, context), 0.0)

    def refresh(self, context: float) -> float:
        return max(_line(self.lengths, self.refresh_s, context), 0.0)

    def catch_up(self, missed: int, context: float) -> float:
        """The draft's extra seconds, before its first draft token, to read ``missed`` tokens plain steps emitted
        (0 if these costs did not measure it; between measured counts linear, beyond the last in proportion: the
        draft reads them in forwards of a fixed number of tokens)."""
        if missed <= 0 or not self.missed:
            return 0.0
        last = self.missed[-1]
        by_length = [float(np.interp(missed, self.missed, row)) if missed <= last else row[-1] * missed / last
                     for row in self.catch_up_s]
        return max(_line(self.lengths, by_length, context), 0.0)

    def round_seconds(self, draft_length: int, refreshed: bool, context: float, missed: int = 0) -> float:
        """A round's modelled seconds; ``missed``: tokens plain steps emitted since the draft last ran."""
        return (draft_length * self.draft(context) + self.verify(draft_length + 1, context)
                + (self.refresh(context) if refreshed else 0.0)
                + (self.catch_up(missed, context) if draft_length else 0.0))

    def features(self, context: float, k_max: int) -> list[float]:
        """What a joint controller reads of the costs at ``context``, in plain target steps: a draft token, the verify
        of k_max drafts beyond a plain step's (per draft), and a refresh."""
        plain = self.verify(1, context)
        return [self.draft(context) / plain, (self.verify(k_max + 1, context) - plain) / (k_max * plain),
                self.refresh(context) / plain]

    def feature_range(self, k_max: int, last: int, first: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The least and the greatest of :meth:`features` (float32, as an observation holds them) over the integer
        contexts ``first`` .. ``last``: an environment's finite observation bounds. Exact, from a few contexts:
        between the measured lengths and the points where a clamped line meets its floor, each cost is affine in
        the context, so each feature (a ratio of two of them, the denominator positive) is monotone there and
        takes its extremes over the integers at the ends of such a piece."""
        if not 1 <= first <= last:
            raise ValueError(f"feature_range needs 1 <= first <= last, got {first} and {last}")
        knots = {float(first), float(last), *map(float, self.lengths)}
        lines = [(self.draft_s, 0.0), (self.refresh_s, 0.0)]
        lines += [([_line(self.blocks, row, q) for row in self.verify_s], 1e-6) for q in (1, k_max + 1)]
        xs = list(self.lengths)
        for ys, floor in lines:
            for i in range(len(xs) - 1):
                slope = (float(ys[i + 1]) - float(ys[i])) / (xs[i + 1] - xs[i])
                if slope:
                    knots.add(xs[i] + (floor - float(ys[i])) / slope)
        contexts = sorted({c for k in knots for c in (math.floor(k), math.ceil(k)) if first <= c <= last})
        values = np.asarray([self.features(c, k_max) for c in contexts], dtype=np.float32)
        return values.min(0), values.max(0)

    # --- files ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        return {**d, "lengths": list(self.lengths), "blocks": list(self.blocks),
                "verify_s": [list(map(float, r)) for r in self.verify_s], "draft_s": list(map(float, self.draft_s)),
                "refresh_s": list(map(float, self.refresh_s)), "missed": list(self.missed),
                "catch_up_s": [list(map(float, r)) for r in self.catch_up_s]}

    @classmethod
    def from_dict(cls, d: dict, where: str = "the cost model") -> "RoundCosts":
        try:
            return cls(tuple(int(x) for x in d["lengths"]), tuple(int(x) for x in d["blocks"]),
                       tuple(tuple(float(x) for x in r) for r in d["verify_s"]),
                       tuple(float(x) for x in d["draft_s"]), tuple(float(x) for x in d["refresh_s"]),
                       int(d["budget"]), str(d.get("steps", "model")), dict(d.get("machine") or {}),
                       tuple(int(x) for x in d.get("missed", ())),
                       tuple(tuple(float(x) for x in r) for r in d.get("catch_up_s", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a round-cost model ({type(e).__name__}: {e})") from None

    def check(self, budget: int | None = None, steps: str | None = None, where: str = "this controller") -> list[str]:
        """The ways the decoder about to run differs from what these costs measured, each warned once (a controller
        still runs: its decisions are just priced for another machine)."""
        now, notes = machine(), []
        diff = [f"{k} {self.machine.get(k)!r} -> {now[k]!r}" for k in now if self.machine.get(k) != now[k]]
        if diff:
            notes.append(f"{where} learned the round costs of another machine ({'; '.join(diff)}): measure this "
                         "one's (train_controller.py --joint) for decisions priced here")
        if budget is not None and budget != self.budget:
            notes.append(f"{where}'s costs were measured at budget {self.budget}, not {budget}")
        if steps is not None and steps != self.steps:
            notes.append(f"{where}'s costs were measured with {self.steps!r} steps, not {steps!r}")
        for n in notes:
            warnings.warn(n, stacklevel=2)
        return notes


def _line(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), extended by the end segments' lines (one point: constant)."""
    xs, ys = list(xs), [float(y) for y in ys]
    if len(xs) == 1:
        return ys[0]
    i = min(max(int(np.searchsorted(xs, x)) - 1, 0), len(xs) - 2)
    t = (x - xs[i]) / (xs[i + 1] - xs[i])
    return ys[i] + t * (ys[i + 1] - ys[i])


MISSED = (1, 2, 4, 8, 16, 48)  # plain-step tokens before a drafting round whose catch-up is measured


def measure_round_costs(decoder, prompts: dict[int, list[int]], draft_lengths=(0, 1, 2, 3, 5, 8, 11),
                        repeats: int = 12, seed: int = 0, progress: bool = False, missed=MISSED) -> RoundCosts:
    """Run real rounds of ``decoder`` (its layout must refresh) on ``prompts`` (context length -> prompt ids): at each
    length, after one warm-up round, ``repeats`` rounds at every draft length k >= 1 in ``draft_lengths``, in a
    shuffled order, every fourth one refreshing, each followed by a plain target step (k = 0). What decides a joint
    controller is a round's cost against a plain step's, and a busy machine's load drifts by more than a verify of 2
    differs from one of 1: so each phase is measured against the plain step beside it (the median of those ratios),
    and the model holds those ratios times the plain steps' median. A wider verify never costs less than a narrower
    one (the running maximum over widths is kept). Then the catch-up: for each count m in ``missed``, m plain steps
    and a round drafting one token, three times; the draft's seconds beyond one draft token (the median) is what
    reading m missed tokens costs."""
    from ..costs import check_refreshable

    check_refreshable(decoder.layout)
    ks = sorted(set(int(k) for k in draft_lengths) | {0})
    if max(ks) > decoder.k or len(ks) < 2:
        raise ValueError(f"draft lengths {ks} must include one >= 1 and stay <= the decoder's k ({decoder.k})")
    order = [k for k in ks if k for _ in range(repeats)]
    np.random.default_rng(seed).shuffle(order)
    missed = sorted(set(int(m) for m in missed))
    need = sum(k + 2 for k in order) + max(ks) + 2 + 3 * sum(m + 4 for m in missed)
    # Phase times need the device finished at each phase's end (a device round otherwise reads it once, at its end).
    phase_sync, decoder.phase_sync = decoder.phase_sync, True
    try:
        return _measure(decoder, prompts, ks, order, missed, need, progress)
    finally:
        decoder.phase_sync = phase_sync


def _measure(decoder, prompts, ks, order, missed, need, progress) -> RoundCosts:
    from tqdm.auto import tqdm

    lengths, verify, draft, refresh, catch_up = sorted(prompts), [], [], [], []
    for length in tqdm(lengths, desc="round costs", disable=not progress):
        decoder.reset(prompts[length], need)
        decoder.step(True, max(ks))  # warm-up: first-call allocations are not a round's cost
        ratios, plain, drafts, refreshes = {k: [] for k in ks}, [], [], []

        def step(refresh: bool, k: int):
            if decoder.done:
                raise ValueError(f"measuring round costs: the generation at {length} tokens ended early (an EOS): "
                                 "give a prompt that continues")
            return decoder.step(refresh, k)

        for i, k in enumerate(order):
            rec, beside = step(i % 4 == 0, k), step(False, 0)
            base = beside.verify_seconds + beside.rollback_seconds
            plain.append(base)
            ratios[k].append((rec.verify_seconds + rec.rollback_seconds) / base)
            drafts.append(rec.draft_seconds / rec.draft_length / base)
            if rec.refreshed:
                refreshes.append(rec.refresh_seconds / base)
        plain_s = median(plain)
        verify.append(tuple(np.maximum.accumulate([plain_s] + [median(ratios[k]) * plain_s for k in ks if k]).tolist()))
        # Each drafting round here follows a plain step, so its draft reads one missed token too (catch_up(1) ~ 0)
        draft.append(median(drafts) * plain_s)
        refresh.append(median(refreshes) * plain_s)
        extra = {m: [] for m in missed}
        for m in [m for m in missed for _ in range(3)]:
            step(False, 1)  # the draft is current: the m plain steps below are all it misses
            for _ in range(m):
                step(False, 0)
            extra[m].append(step(False, 1).draft_seconds - draft[-1])
        catch_up.append(tuple(max(median(extra[m]), 0.0) for m in missed))
    steps = decoder.verify_step if decoder.verify_step == decoder.draft_step else (
        f"{decoder.draft_step}/{decoder.verify_step}")
    return RoundCosts(tuple(lengths), tuple(k + 1 for k in ks), tuple(verify), tuple(draft), tuple(refresh),
                      decoder.layout.budget, steps, missed=tuple(missed), catch_up_s=tuple(catch_up))
