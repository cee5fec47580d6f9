"""A round with both static steps runs on the device and reads it back once (gpt-fast's shape): the drafts are drawn
by the draft step, the acceptance test runs as tensor code, and one read brings the round's results (and the cache
signals the decision before it read, if none were read then) to the host. Counted on CPU by patching every tensor
method through which Python reads a tensor's values; the same round through the host path is the control that shows
the counter sees reads. The round stays lossless and keeps the signals the host path publishes."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from rift_ada.evaluate import decode
from rift_ada.models import greedy_reference
from rift_ada.policies import make_policy
from rift_ada.refresh import PeriodicController
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import random_model

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def counting_reads(monkeypatch):
    """Counts of calls to each tensor method that moves values to the host (on a GPU: a synchronisation each)."""
    counts = collections.Counter()
    with monkeypatch.context() as m:
        for name in READS:
            def counted(self, *args, _orig=getattr(torch.Tensor, name), _name=name, **kwargs):
                counts[_name] += 1
                return _orig(self, *args, **kwargs)
            m.setattr(torch.Tensor, name, counted)
        yield counts


def one_read_a_round(counts, step, plan):
    """Run ``step(refresh, k)`` for each of ``plan``, asserting each reads the device once; the last one's result."""
    for refresh, k in plan:
        before = sum(counts.values())
        out = step(refresh, k)
        assert sum(counts.values()) - before == 1, (refresh, k, dict(counts))
    return out


def models():
    target = random_model("llama", vocab=128, layers=2, hidden=64, heads=4, kv_heads=2, init=0.2)
    draft = random_model("llama", vocab=128, layers=2, hidden=64, heads=4, kv_heads=2, seed=3, init=0.2)
    return target, draft


def prompt(n: int = 80, seed: int = 0) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafter", ["self", "other"])
def test_a_device_round_reads_the_device_once(monkeypatch, temperature, drafter):
    """Rounds that refresh, reject, accept every draft (self-speculation over a cache holding the whole prompt: two
    pending tokens next round), draft fewer tokens and none (a plain target step): each reads the device once, and
    reading the state costs one read more, once. The host path's round reads far more (the counter's control)."""
    target, draft = models()
    budget = 160 if drafter == "self" else 24  # self: the budget holds every token, so every draft is accepted
    layout = make_policy("rift-dyn", budget, period=8, obs_window=8).layout
    draft = None if drafter == "self" else draft
    kw = dict(draft_length=4, temperature=temperature, seed=1)
    dec = SpeculativeDecoder(target, draft, layout, draft_step="static", verify_step="static", **kw)
    dec.reset(prompt(), 60)
    plan = [(True, None), (False, None), (False, 2), (False, 0), (True, None), (False, None), (False, None)]
    with counting_reads(monkeypatch) as counts:
        rec = one_read_a_round(counts, dec.step, plan)
        before = sum(counts.values())
        dec.state, dec.state
        assert sum(counts.values()) - before == 1, "the state's cache signals: one read, once"
        dec.step(False)
        assert sum(counts.values()) - before == 2
    assert dec.host_reads == len(plan) + 1 and rec.refreshed is False
    rounds = dec.result.rounds
    if drafter == "self" and temperature == 0:
        assert all(r.accepted == r.draft_length for r in rounds), "every draft accepted: two pending tokens"
    if drafter == "other":
        assert any(r.accepted < r.draft_length for r in rounds), "a rejection"
    host = SpeculativeDecoder(target, draft, layout, draft_step="static", verify_step="model", **kw)
    host.reset(prompt(), 60)
    with counting_reads(monkeypatch) as counts:
        host.step(False)
    assert sum(counts.values()) > 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafter", ["self", "other"])
def test_a_batched_device_round_reads_the_device_once(monkeypatch, temperature, drafter):
    """The same plan for a batch of 4 rows of 80, 61, 97 and 70 tokens (``rift_ada.batch`` on the static steps),
    each row refreshing on its own rounds: every round, whatever it does to each row, is one read of the device for
    the whole batch; then the batch's states cost one read per row (each row's cache signals, once), and every row
    ends with the target's own greedy tokens (greedy) or two rounds of plain steps in a row caught up (sampled)."""
    from rift_ada.batch import BatchDecoder

    target, draft = models()
    budget = 160 if drafter == "self" else 24
    layout = make_policy("rift-dyn", budget, period=8, obs_window=8).layout
    draft = None if drafter == "self" else draft
    dec = BatchDecoder(target, draft, layout, draft_length=4, temperature=temperature, seed=1, draft_step="static",
                       verify_step="static")
    prompts = [prompt(n, seed=i) for i, n in enumerate((80, 61, 97, 70))]
    dec.reset(prompts, 60)
    plan = [([True, False, True, False], None), ([False] * 4, None), ([False, True, False, False], 2),
            ([False] * 4, 0), ([False] * 4, 0), ([True] * 4, None), ([False] * 4, None), ([False] * 4, None)]
    with counting_reads(monkeypatch) as counts:
        out = one_read_a_round(counts, dec.step, plan)
        before = sum(counts.values())
        dec.states, dec.states
        assert sum(counts.values()) - before == 4, "each row's cache signals: one read, once"
    assert dec.host_reads == len(plan) and len(out.records) == 4
    assert [r.refreshes for r in dec.results] == [2, 2, 2, 1]
    if temperature == 0:
        while not dec.done:
            dec.step()
        assert [r.tokens for r in dec.results] == [greedy_reference(target, p, 60) for p in prompts]


def test_device_rounds_publish_what_host_rounds_publish():
    """Greedy, the same draft step: the device round and the host round emit the same tokens in the same rounds,
    and record the same signals (read back with the next round, or when the state is read)."""
    target, draft = models()
    layout = make_policy("rift-dyn", 24, period=8, obs_window=8).layout
    runs = []
    for verify in ("static", "model"):
        dec = SpeculativeDecoder(target, draft, layout, draft_length=4, draft_step="static", verify_step=verify)
        out = decode(dec, prompt(), 40, PeriodicController(5))
        runs.append((out, dec.state))
    (a, sa), (b, sb) = runs
    assert a.tokens == b.tokens == greedy_reference(target, prompt(), 40)
    assert [(r.accepted, r.refreshed) for r in a.rounds] == [(r.accepted, r.refreshed) for r in b.rounds]
    for x, y in zip(a.rounds, b.rounds):
        for name in ("drift", "runway", "focus", "entropy_mean", "entropy_max"):
            assert getattr(x, name) == pytest.approx(getattr(y, name), abs=1e-5), name
    for name in ("drift", "runway", "focus", "drift_floor", "target_p", "match"):
        assert getattr(sa, name) == pytest.approx(getattr(sb, name), abs=1e-5), name


@pytest.mark.parametrize("chunk", [16, 33])
def test_chunked_prefill_is_lossless(chunk):
    """A prompt prefilled ``chunk`` tokens per forward (the default on CUDA for long prompts): greedy output still
    the target's own, for an external draft and self-speculation, and a bad chunk is refused in one line."""
    target, draft = models()
    layout = make_policy("rift-dyn", 24, period=8, obs_window=8).layout
    want = greedy_reference(target, prompt(), 30)
    for d in (draft, None):
        dec = SpeculativeDecoder(target, d, layout, draft_length=4, draft_step="static", verify_step="static",
                                 prefill_chunk=chunk)
        assert decode(dec, prompt(), 30, PeriodicController(4)).tokens == want
    with pytest.raises(ValueError, match="prefill_chunk must be") as e:
        SpeculativeDecoder(target, draft, layout, prefill_chunk=-1)
    assert "\n" not in str(e.value)
