"""A hindsight oracle for refresh timing: the best schedule a bounded search over forks finds for one prompt.

No controller can do better than knowing the future; this one does, within bounds. Generation is cut into blocks of
``block`` rounds; at the start of each block a beam of decoder forks branches into "refresh now" and "keep", decodes
the block without further refreshes, and keeps the ``beam`` best branches by

    score = accepted draft tokens so far - lam * refreshes so far

(at the same round count, more accepted tokens also means further along). Branches that reach the end are scored the
same way; the best finished one is the oracle's schedule. Over a fixed number of generated tokens N, accepted tokens
are N - rounds, so the score ranks schedules by rounds + lam * refreshes: lam prices a refresh in target rounds, and
sweeping lam traces the oracle's AL-versus-refreshes curve, drawn beside the controllers' (``train_controller.py``).

Bounded, not exhaustive: decisions only at block starts, at most one refresh per block, ``beam`` branches kept. Its
cost is about 2 x beam decodes of the prompt. Greedy forks all emit the target's greedy tokens; sampled forks share
their random numbers up to where they differ (``SpeculativeDecoder.fork`` copies the generator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .metrics import acceptance_length


@dataclass
class OracleResult:
    acceptance_length: float
    refreshes: int
    rounds: int
    tokens: int
    drafted: int  # draft tokens proposed over all rounds (the modelled time's draft steps)
    schedule: list[int] = field(default_factory=list)  # rounds (0-based) at which the oracle refreshed
    score: float = 0.0


@dataclass
class _Branch:
    decoder: object
    accepted: int = 0
    refreshes: int = 0
    schedule: list = field(default_factory=list)

    def score(self, lam: float) -> float:
        return self.accepted - lam * self.refreshes


def oracle_schedule(decoder, prompt_ids: Sequence[int], max_new_tokens: int, lam: float, block: int = 4,
                    beam: int = 4) -> OracleResult:
    """The best refresh schedule found for ``prompt_ids`` with refreshes priced at ``lam`` accepted tokens (module
    docstring). ``decoder`` is reset and left at the root; its layout must refresh."""
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    if block < 1 or beam < 1:
        raise ValueError(f"block and beam must be >= 1, got block={block}, beam={beam}")
    if not decoder.layout.refreshable:
        raise ValueError(f"the oracle needs a draft cache that refreshes, not {decoder.layout.describe()}")
    decoder.reset(list(prompt_ids), max_new_tokens)
    live, finished = [_Branch(decoder)], []
    while live:
        children = []
        for b in live:
            for refresh in (True, False):
                if refresh and b.decoder.tokens_since_refresh == 0:
                    continue  # nothing new to score since the last refresh: same as keeping, but charged
                child = _Branch(b.decoder.fork(), b.accepted, b.refreshes, list(b.schedule))
                for i in range(block):
                    if child.decoder.done:
                        break
                    now = refresh and i == 0
                    if now:
                        child.refreshes += 1
                        child.schedule.append(len(child.decoder.result.rounds))
                    child.accepted += child.decoder.step(now).accepted
                children.append(child)
        children.sort(key=lambda c: (-c.score(lam), c.refreshes))
        finished += [c for c in children if c.decoder.done]
        live = [c for c in children if not c.decoder.done][:beam]
    best = max(finished, key=lambda c: (c.score(lam), -c.refreshes))
    res = best.decoder.result
    return OracleResult(acceptance_length(res.rounds), best.refreshes, len(res.rounds), len(res.tokens),
                        sum(r.draft_length for r in res.rounds), best.schedule, best.score(lam))
