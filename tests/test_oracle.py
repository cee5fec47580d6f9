"""The hindsight oracle: its schedule is real (replayed, it gives the AL it reports), it is the exhaustive optimum
when the beam holds every branch, and a prohibitive refresh price leaves the never-refresh schedule."""

import itertools

import pytest

from rift_ada.layout import CacheLayout
from rift_ada.metrics import acceptance_length
from rift_ada.oracle import oracle_schedule
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import cached_testbed_pair, train_prompts

MAX_NEW, BLOCK = 24, 4  # 512-token prompt, budget 64: 15 rounds, 5 block starts, all 32 schedules


@pytest.fixture(scope="module")
def setup():
    # Self-speculation with a small budget: the selection goes stale after two rounds, and refreshing pays.
    pair = cached_testbed_pair("self")
    dec = SpeculativeDecoder(pair.target, None, CacheLayout("rift", 64), draft_length=8,
                             eos_token_id=pair.tokenizer.eos_token_id)
    return dec, list(train_prompts(2, 512)[0])


def replay(dec, ids, schedule):
    """Decode ``ids`` refreshing at the given rounds; (score parts, result)."""
    dec.reset(ids, MAX_NEW)
    r = 0
    while not dec.done:
        dec.step(r in schedule)
        r += 1
    res = dec.result
    return sum(x.accepted for x in res.rounds), res


def test_schedule_replays_to_what_it_reports(setup):
    dec, ids = setup
    out = oracle_schedule(dec, ids, MAX_NEW, lam=0.5, block=BLOCK, beam=2)
    accepted, res = replay(dec, ids, set(out.schedule))
    assert sum(x.refreshed for x in res.rounds) == out.refreshes == len(out.schedule)
    assert acceptance_length(res.rounds) == out.acceptance_length and len(res.rounds) == out.rounds
    assert accepted - 0.5 * out.refreshes == out.score


def test_wide_beam_is_the_exhaustive_optimum(setup):
    """Every schedule that refreshes at block starts, decoded in full: none scores above the oracle's."""
    dec, ids = setup
    lam = 0.5
    out = oracle_schedule(dec, ids, MAX_NEW, lam=lam, block=BLOCK, beam=1 << 10)
    _, never = replay(dec, ids, set())
    # Block starts after round 0 (the oracle does not refresh a cache scored at prefill), a margin past the end
    # of the never-refresh decode: refreshing only shortens it here.
    starts = range(BLOCK, len(never.rounds) + 2 * BLOCK, BLOCK)
    best, scores = None, set()
    for n in range(len(starts) + 1):
        for chosen in itertools.combinations(starts, n):
            accepted, res = replay(dec, ids, set(chosen))
            used = {r for r in chosen if r < len(res.rounds)}
            if len(used) != len(chosen):
                continue  # a refresh after the end: the same schedule as one without it
            score = accepted - lam * len(chosen)
            scores.add(score)
            best = score if best is None else max(best, score)
    assert len(scores) > 1, "every schedule scores the same: the check would not discriminate"
    assert out.score == pytest.approx(best)


def test_prohibitive_price_never_refreshes(setup):
    dec, ids = setup
    out = oracle_schedule(dec, ids, MAX_NEW, lam=1e6, block=BLOCK, beam=2)
    _, never = replay(dec, ids, set())
    assert out.refreshes == 0 and out.acceptance_length == acceptance_length(never.rounds)


def test_bad_input(setup):
    dec, ids = setup
    with pytest.raises(ValueError, match="lam"):
        oracle_schedule(dec, ids, MAX_NEW, lam=-1)
    with pytest.raises(ValueError, match="block"):
        oracle_schedule(dec, ids, MAX_NEW, lam=1, block=0)
    full = SpeculativeDecoder(dec.target, dec.draft, CacheLayout("full"))
    with pytest.raises(ValueError, match="refreshes"):
        oracle_schedule(full, ids, MAX_NEW, lam=1)
