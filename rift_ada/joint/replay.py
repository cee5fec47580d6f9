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


def replay_joint(tables, act, costs: RoundCosts, k_max: int = 11, episodes: int = 4, seed: int = 0,
                 price_at: int | None = None) -> dict:
    """``act(state) -> (refresh, k)`` replayed over ``tables``, each priced at its prompt length (``price_at``: at
    that prompt length instead, what it accepts staying the table's), each sampling table ``episodes`` times:
    tokens, seconds, modelled tokens/s, AL over drafting rounds, refreshes, and how often each k was chosen (share of
    rounds)."""
    tokens = seconds = refreshes = 0.0
    accepted, drafting, ks = 0, 0, Counter()
    for i, table in enumerate(tables):
        rng = np.random.default_rng(seed + i)
        replay = Replay(table, k_max)
        for _ in range(1 if table.temperature == 0 else episodes):
            replay.reset(rng, prompt_tokens=price_at)
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


def modelled_paths(tables, costs: RoundCosts, full_draft_s, k: int = 11, period: int = 32, controller=None,
                   price_at: int | None = None, episodes: int = 4) -> dict:
    """Modelled decode tokens/s of each way to decode ``tables``' prompts under ``costs`` (measured on a device at
    real shapes, ``experiments/gpu_check.py``): ``greedy`` (one plain target step a token), ``full`` (k drafts a
    round from the full-cache draft, whose step costs ``full_draft_s`` per measured length: the tables' ``full_q``),
    ``rift_dyn`` (k drafts from the compressed cache, refreshed every ``period`` generated tokens) and ``joint``
    (``controller``, a joint controller, deciding each round with these costs). ``price_at``: the prompt length the
    rounds are priced at (the tables' acceptance stays theirs)."""
    from dataclasses import replace

    from ..replay.table import ReplayTable

    full_tables = [ReplayTable(**{**t.__dict__, "q": np.broadcast_to(t.full_q, t.q.shape)}) for t in tables]
    full_costs = replace(costs, draft_s=tuple(float(x) for x in full_draft_s), refresh_s=(0.0,) * len(costs.lengths))
    runs = {"greedy": (tables, lambda s: (False, 0), costs, k),
            "full": (full_tables, lambda s: (False, k), full_costs, k),
            "rift_dyn": (tables, lambda s: (s.tokens_since_refresh >= period, k), costs, k)}
    if controller is not None:
        controller.prices = costs  # a learned controller decides by the costs it is priced with
        runs["joint"] = (tables, controller.act, costs, controller.k_max)
    return {name: replay_joint(ts, act, c, k_max, episodes, price_at=price_at)
            for name, (ts, act, c, k_max) in runs.items()}
