"""A cost model of speculative-decoding rounds in seconds, measured once on the running hardware.

Rewards and tradeoff curves in time must not read the wall clock while they run (they would change from run to run
and with the machine's load): instead ``measure_costs`` times a few rounds once, and every round is then *modelled*
from its record alone:

    round seconds = draft_length * draft_step_s + verify_s + refresh_s * [the round refreshed]

- ``draft_step_s``: median over rounds of ``RoundRecord.draft_seconds / draft_length`` (one draft forward on the
  compressed cache, sampling included);
- ``verify_s``: median of ``verify_seconds + rollback_seconds`` (the target's forward over the drafts and putting
  both caches back to the kept tokens: what every round pays whatever it drafts);
- ``refresh_s``: median of ``refresh_seconds`` over the rounds that refreshed (one rescoring of the draft cache).

Modelled tokens per second = generated tokens / the sum of their rounds' modelled seconds (prefill not counted).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import median
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .speculative import DecodeResult, RoundRecord, SpeculativeDecoder


@dataclass(frozen=True)
class CostModel:
    draft_step_s: float  # one draft token (a draft forward on the compressed cache)
    verify_s: float  # one round's verification by the target, rollback included
    refresh_s: float  # one refresh (rescoring) of the draft cache

    def __post_init__(self):
        for name, v in asdict(self).items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"CostModel.{name} must be a finite number of seconds >= 0, got {v!r}")
        if self.verify_s <= 0:
            raise ValueError(f"CostModel.verify_s must be > 0 (every round verifies), got {self.verify_s!r}")

    def round_seconds(self, draft_length: int, refreshed: bool, refresh_weight: float = 1.0) -> float:
        """A round's modelled time; ``refresh_weight`` scales the refresh term (1: the measured cost)."""
        return draft_length * self.draft_step_s + self.verify_s + (refresh_weight * self.refresh_s if refreshed else 0.0)

    def total_seconds(self, drafted: int, rounds: int, refreshes: int) -> float:
        """The modelled time of ``rounds`` rounds that drafted ``drafted`` tokens in all and refreshed ``refreshes``
        times (the sum of their ``round_seconds``)."""
        return drafted * self.draft_step_s + rounds * self.verify_s + refreshes * self.refresh_s

    def seconds(self, rounds: Sequence[RoundRecord]) -> float:
        return self.total_seconds(sum(r.draft_length for r in rounds), len(rounds), sum(r.refreshed for r in rounds))

    def tokens_per_second(self, results: Sequence[DecodeResult]) -> float:
        """Modelled decoding speed over ``results``: their generated tokens / their rounds' modelled seconds."""
        seconds = sum(self.seconds(r.rounds) for r in results)
        return sum(len(r.tokens) for r in results) / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(float(d["draft_step_s"]), float(d["verify_s"]), float(d["refresh_s"]))


def check_refreshable(layout) -> None:
    """ValueError (one line) unless ``layout``'s draft cache refreshes: a refresh cannot be timed otherwise."""
    if not layout.refreshable:
        raise ValueError(f"measuring refresh costs needs a draft cache that refreshes, not {layout.describe()}")


def measure_costs(decoder: SpeculativeDecoder, prompt: Sequence[int], max_new_tokens: int = 128,
                  refresh_every: int = 2, min_rounds: int = 6) -> CostModel:
    """Decode ``prompt`` once with ``decoder`` (it is reset; its layout must refresh), refreshing every
    ``refresh_every``-th round, and take the medians of the rounds' phase times (see the module docstring).
    ValueError (one line) when the generation gives fewer than ``min_rounds`` rounds, or none that refreshed."""
    check_refreshable(decoder.layout)
    if refresh_every < 1:
        raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
    decoder.reset(list(prompt), max_new_tokens)
    rounds = list(decoder.rounds(lambda state: state.rounds % refresh_every == 0))
    drafted = [r for r in rounds if r.draft_length > 0]
    refreshed = [r for r in rounds if r.refreshed]
    if len(drafted) < min_rounds or not refreshed:
        raise ValueError(f"measuring costs: {max_new_tokens} new tokens gave {len(drafted)} drafting rounds "
                         f"({len(refreshed)} refreshing); need {min_rounds}, one refreshing: raise max_new_tokens")
    return CostModel(draft_step_s=median(r.draft_seconds / r.draft_length for r in drafted),
                     verify_s=median(r.verify_seconds + r.rollback_seconds for r in rounds),
                     refresh_s=median(r.refresh_seconds for r in refreshed))
