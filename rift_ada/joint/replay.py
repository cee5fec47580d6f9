"""Joint controllers over replay tables: each round's (refresh, k) replayed and priced by a measured cost model.

Each table is priced at its own prompt length (the length its states report, so a controller keyed on context reads
the same). Modelled tokens per second = tokens / the sum of
the rounds' modelled seconds (``RoundCosts.round_seconds`` at each round's context), prefill apart, as the bench
measures decode.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..replay.process import Replay
from .costs import RoundCosts


def priced_step(replay: Replay, refresh: bool, k: int, costs: RoundCosts):
    """One replayed round and its modelled seconds (at the context before it: prompt + generated; after the plain
    steps since the draft last ran)."""
    context, missed = replay.prompt_tokens + replay.g, replay.since_draft
    rec = replay.step(refresh, k)
    return rec, costs.round_seconds(rec.draft_length, rec.refreshed, context, missed)


def replay_joint(tables, act, costs: RoundCosts, k_max: int = 11, episodes: int = 4, seed: int = 0) -> dict:
    """``act(state) -> (refresh, k)`` replayed over ``tables``, each priced at its prompt length, each sampling table
    ``episodes`` times: tokens, seconds, modelled tokens/s, AL over drafting rounds, refreshes, and how often
    each k was chosen (share of rounds)."""
    tokens = seconds = refreshes = 0.0
    accepted, drafting, ks = 0, 0, Counter()
    for i, table in enumerate(tables):
        rng = np.random.default_rng(seed + i)
        replay = Replay(table, k_max)
        for _ in range(1 if table.temperature == 0 else episodes):
            replay.reset(rng)
            while not replay.done:
                refresh, k = act(replay.state)
                rec, s = priced_step(replay, refresh, k, costs)
                seconds += s
                ks[rec.draft_length] += 1
                refreshes += rec.refreshed
                if rec.draft_length:
                    accepted, drafting = accepted + rec.accepted + 1, drafting + 1
            tokens += replay.g - 1  # the first token comes with the prefill
    rounds = sum(ks.values())
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "acceptance_length": accepted / drafting if drafting else 0.0, "refreshes": refreshes,
            "k_share": {int(k): n / rounds for k, n in sorted(ks.items())}}
