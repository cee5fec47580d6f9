"""One refresh schedule run twice, in the real decoder and in replay, round by round (what
``experiments/replay_fidelity.py`` and ``experiments/regime_check.py`` compare)."""

from __future__ import annotations

import numpy as np

Round = tuple[int, int, bool]  # (position, accepted, refreshed)


def real_rounds(decoder, ids, max_new, controller, policy, grid, follow=None) -> list[Round]:
    """(position, accepted, refreshed) of each round of the real decoder under ``controller`` or, for the oracle,
    ``policy`` read at the decoder's own (generated, pending, row). ``follow`` (a continuation's tokens): stop after
    the first round whose tokens leave it (a sampled decode draws its own continuation; past that point a replay of
    ``follow`` says nothing about it)."""
    from rift_ada.refresh.base import refresh_wanted

    decoder.reset(ids, max_new)
    row, P = 0, len(ids)

    def decide(state) -> bool:
        nonlocal row
        g = len(decoder.result.tokens)
        pending = P + g - decoder.dcache.length
        refresh = policy.at(g, pending, row) if policy is not None else refresh_wanted(controller, state)
        if refresh:
            row = (g - pending) // grid
        return refresh

    rounds = []
    for rec in decoder.rounds(decide):
        rounds.append((rec.position, rec.accepted, bool(rec.refreshed)))
        span = slice(rec.position, rec.position + rec.emitted)
        if follow is not None and list(decoder.result.tokens[span]) != list(follow[span]):
            break
    return rounds


def replayed(table, k, controller, policy, episodes, seed) -> list[list[Round]]:
    """The same schedule's rounds replayed on ``table``: once greedy, ``episodes`` times sampling
    (``process.table_replays``)."""
    from rift_ada.replay.process import table_replays

    runs = table_replays([table], policy.refreshes if policy is not None else controller, k, episodes, seed)[0]
    return [[(x.position, x.accepted, x.refreshed) for x in r.rounds] for r in runs]


def al(rounds: list[Round]) -> float:
    """Acceptance length: tokens emitted per round (the accepted drafts plus the target's own token)."""
    return float(np.mean([a + 1 for _, a, _ in rounds]))


def within(rounds: list[Round], end: int) -> list[Round]:
    """The rounds whose emitted tokens all lie in the first ``end`` generated tokens (a round at position g emits
    tokens g .. g + accepted)."""
    return [r for r in rounds if r[0] + r[1] + 1 <= end]


def refreshes(rounds: list[Round]) -> int:
    return sum(r for *_, r in rounds)
