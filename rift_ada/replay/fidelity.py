"""One refresh schedule run twice, in the real decoder and in replay, round by round (what
``experiments/replay_fidelity.py`` and ``experiments/regime_check.py`` compare)."""

from __future__ import annotations

import numpy as np

Round = tuple[int, int, bool]  # (position, accepted, refreshed)


def real_rounds(decoder, ids, max_new, controller, policy, grid) -> list[Round]:
    """(position, accepted, refreshed) of each round of the real decoder under ``controller`` or, for the oracle,
    ``policy`` read at the decoder's own (generated, pending, row)."""
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

    return [(rec.position, rec.accepted, bool(rec.refreshed)) for rec in decoder.rounds(decide)]


def replayed(table, k, controller, policy, episodes, seed) -> list[list[Round]]:
    """The same schedule's rounds replayed on ``table``: once greedy, ``episodes`` times sampling
    (``process.table_replays``)."""
    from rift_ada.replay.process import table_replays

    runs = table_replays([table], policy.refreshes if policy is not None else controller, k, episodes, seed)[0]
    return [[(x.position, x.accepted, x.refreshed) for x in r.rounds] for r in runs]


def al(rounds: list[Round]) -> float:
    """Acceptance length: tokens emitted per round (the accepted drafts plus the target's own token)."""
    return float(np.mean([a + 1 for _, a, _ in rounds]))


def refreshes(rounds: list[Round]) -> int:
    return sum(r for *_, r in rounds)
