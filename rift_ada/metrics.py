"""Metrics computed from per-round records, in one place, so every script reports the same numbers.

AL (acceptance length) = tokens produced per target forward = accepted drafts + 1, averaged over a request's rounds,
then over requests (SPEED-Bench's convention). The first token, which comes from the target's prefill, is not a
round and is not counted.
"""

from __future__ import annotations

from statistics import mean
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .speculative import DecodeResult, RoundRecord


def acceptance_length(rounds: Sequence[RoundRecord]) -> float:
    return mean(r.accepted + 1 for r in rounds) if rounds else 0.0


def al_by_quarter(rounds: Sequence[RoundRecord], total_tokens: int) -> list[float | None]:
    """AL of the rounds starting in each quarter of the generation (None where a quarter has no round)."""
    buckets: list[list[RoundRecord]] = [[], [], [], []]
    for r in rounds:
        buckets[min(3, r.position * 4 // max(total_tokens, 1))].append(r)
    return [acceptance_length(b) if b else None for b in buckets]


def refreshes_per_1k(results: Sequence[DecodeResult]) -> float:
    tokens = sum(len(r.tokens) for r in results)
    return 1000.0 * sum(r.refreshes for r in results) / max(tokens, 1)


def summarize(results: Sequence[DecodeResult], max_new_tokens: int) -> dict:
    """Aggregate a run over prompts (per-request averages, then the mean over requests)."""
    quarters = [al_by_quarter(r.rounds, max_new_tokens) for r in results]
    by_q = []
    for q in range(4):
        vals = [row[q] for row in quarters if row[q] is not None]
        by_q.append(mean(vals) if vals else None)
    tokens = sum(len(r.tokens) for r in results)
    rounds = sum(len(r.rounds) for r in results)
    decode_s = sum(r.decode_seconds for r in results)
    return {
        "acceptance_length": mean(acceptance_length(r.rounds) for r in results),
        "acceptance_length_by_quarter": by_q,
        "refreshes": sum(r.refreshes for r in results),
        "refreshes_per_1k_tokens": refreshes_per_1k(results),
        "generated_tokens": tokens,
        "tokens_per_second": tokens / decode_s if decode_s > 0 else 0.0,
        "prefill_seconds": sum(r.prefill_seconds for r in results),
        # Peaks over all rounds: the total, and separately its full-attention (RIFT) and sliding-window parts.
        "draft_active_kv_bytes": max((x.active_kv_bytes for r in results for x in r.rounds), default=0),
        "draft_active_kv_bytes_full": max((x.active_kv_bytes_full for r in results for x in r.rounds), default=0),
        "draft_active_kv_bytes_sliding": max((x.active_kv_bytes_sliding for r in results for x in r.rounds),
                                             default=0),
        # Hybrid drafts: linear-attention states (fixed in input length) and the rollback copies of them, apart
        # from the attention KV above.
        "draft_state_bytes": max((x.state_bytes for r in results for x in r.rounds), default=0),
        "draft_state_checkpoint_bytes": max((x.state_checkpoint_bytes for r in results for x in r.rounds), default=0),
        # What rolling both caches back costs: per round, and the share of rounds in which a hybrid target fed its
        # kept tokens again.
        "rollback_ms_per_round": 1000 * mean(x.rollback_seconds for r in results for x in r.rounds) if rounds else 0.0,
        "target_replay_share": mean(x.target_replayed for r in results for x in r.rounds) if rounds else 0.0,
        "prompts": len(results),
    }
