import numpy as np
import pytest
import torch
from transformers import DynamicCache

from rift_ada import signals
from rift_ada.data import build_tasks, encode
from rift_ada.evaluate import decode
from rift_ada.layout import CacheLayout
from rift_ada.models import greedy_reference
from rift_ada.policies import POLICIES, make_policy
from rift_ada.scorers import SCORERS
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import (SCRIPT, SCRIPT_K, decode_checking_rollback, feed, random_model, script_tokens,
                            scripted_draft)


class EveryOtherRound:
    """A controller that refreshes before every second round (it counts its own calls)."""

    def __init__(self):
        self.calls = 0

    def decide(self, observation):
        self.calls += 1
        return self.calls % 2 == 1


def policy(name, scorer="snapkv", budget=96):
    return make_policy(name, budget=None if name == "full" else budget, period=8 if name == "rift-dyn" else None,
                       controller=EveryOtherRound() if name == "rift-ada" else None, scorer=scorer, obs_window=16)


@pytest.fixture(scope="module")
def testbed_prompt(tokenizer):
    return encode(tokenizer, build_tasks(tokenizer, "low", n=1, input_tokens=1024, seed=5)[0].prompt)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("drafter", ["self", "external"])
def test_greedy_equals_target_generate_testbed_policies(name, drafter, testbed_target, testbed_draft, testbed_prompt):
    reference = greedy_reference(testbed_target, testbed_prompt, 40)
    draft = None if drafter == "self" else testbed_draft
    pol = policy(name, budget=256)
    dec = SpeculativeDecoder(testbed_target, draft, pol.layout, draft_length=11)
    res = decode(dec, testbed_prompt, 40, pol.controller)
    assert res.refreshes > 0 if name in ("rift-dyn", "rift-ada") else res.refreshes == 0
    assert res.tokens == reference
    # What the layout must hold after the last round (the prompt, 1024 tokens, exceeds the budget of 256):
    fed = dec.dcache.length  # tokens the draft has seen
    expected = {"full": fed, "snapkv": 256 + fed - len(testbed_prompt)}.get(name, 256)  # snapkv: evicts none
    assert dec.dcache.active_tokens() == expected
    # ... and during a round at most k + 1 more: pending tokens (1 or 2) + the k - 1 drafts fed back.
    cfg = dec.draft.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dec.draft.dtype.itemsize
    if name not in ("full", "snapkv"):
        assert max(r.active_kv_bytes for r in res.rounds) <= (256 + 11 + 1) * per_token


@pytest.mark.parametrize("scorer", list(SCORERS))
def test_greedy_equals_target_generate_testbed_scorers(scorer, testbed_target, testbed_draft, testbed_prompt):
    reference = greedy_reference(testbed_target, testbed_prompt, 40)
    pol = policy("rift-dyn", scorer, budget=128)
    for draft in (None, testbed_draft):
        dec = SpeculativeDecoder(testbed_target, draft, pol.layout, draft_length=11)
        assert decode(dec, testbed_prompt, 40, pol.controller).tokens == reference


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", ["full", "window", "snapkv", "rift-stat", "rift-dyn"])
def test_greedy_equals_target_generate_random_models(arch, name):
    target = random_model(arch, seed=0)
    draft = random_model(arch, layers=1, seed=1)
    prompt = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = greedy_reference(target, prompt, 48)
    pol = policy(name, budget=64)
    for d in (None, draft):
        for k in (1, 4, 11):
            res = decode(SpeculativeDecoder(target, d, pol.layout, draft_length=k), prompt, 48, pol.controller)
            assert res.tokens == reference, (d is None, k)


def decode_with_round_lengths(dec, prompt, new_tokens, k_max, seed=0, refresh_every=3) -> tuple[list, list]:
    """Greedy decode where every round drafts a random k in 0..k_max (0: a plain target step) and every
    ``refresh_every``-th round refreshes: (tokens, the round lengths used)."""
    rng = np.random.default_rng(seed)
    dec.reset(prompt, new_tokens)
    lengths = []
    while not dec.done:
        lengths.append(int(rng.integers(0, k_max + 1)))
        dec.step(refresh=len(lengths) % refresh_every == 0 and dec.layout.refreshable, draft_length=lengths[-1])
    return dec.result.tokens, lengths


@pytest.mark.parametrize("step", ["model", "static"])
@pytest.mark.parametrize("name", ["full", "rift-stat", "rift-dyn"])
def test_greedy_is_lossless_at_every_round_length(name, step):
    """A round may draft any k up to the decoder's (the joint controller's action): greedy output stays the
    target's, k = 0 rounds (one target step, the draft catching up later) included."""
    target = random_model("llama", seed=0)
    draft = random_model("llama", layers=1, seed=1)
    prompt = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = greedy_reference(target, prompt, 48)
    pol = policy(name, budget=64)
    for d in (None, draft):
        dec = SpeculativeDecoder(target, d, pol.layout, draft_length=6, draft_step=step, verify_step=step)
        tokens, lengths = decode_with_round_lengths(dec, prompt, 48, 6)
        assert tokens == reference and 0 in lengths and 6 in lengths, (d is None, lengths)
        assert [r.draft_length for r in dec.result.rounds] == [min(k, 48 - r.position - 1)
                                                               for k, r in zip(lengths, dec.result.rounds)]
    with pytest.raises(ValueError, match=r"draft_length must be an integer in \[0, 6\]"):
        dec.reset(prompt, 8)
        dec.step(draft_length=7)


def scripted_run():
    """A random Llama target and its scripted copy (tests/conftest.py) whose rounds accept SCRIPT, then all k; a
    rift-dyn draft cache (budget 64 against a 150-token prompt) refreshed before every other round."""
    target = random_model("llama", seed=0)
    prompt = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = greedy_reference(target, prompt, script_tokens())
    draft = scripted_draft(target, prompt, reference, SCRIPT, SCRIPT_K)
    pol = policy("rift-ada", budget=64)  # EveryOtherRound
    return SpeculativeDecoder(target, draft, pol.layout, draft_length=SCRIPT_K), pol.controller, prompt, reference


def test_rollback_leaves_caches_as_if_never_fed():
    """Rounds that accept every count 0..k (asserted), a compressed draft cache refreshed every other round: after
    each round both caches hold exactly the kept tokens, the draft's bit for bit as if the rejected ones were never
    fed (tests/conftest.py decode_checking_rollback: keys, values, backing store, selection, recorded queries). At
    the end the target's cache equals a fresh prefill and the draft's layer-0 backing store (keys that do not
    depend on the cache) holds the keys of exactly the kept tokens."""
    dec, controller, prompt, reference = scripted_run()
    accepted = decode_checking_rollback(dec, prompt, script_tokens(), controller)
    assert accepted == SCRIPT + [SCRIPT_K] * 2 and set(accepted) == set(range(SCRIPT_K + 1))
    assert dec.result.tokens == reference and dec.result.refreshes == len(accepted) // 2
    seen = prompt + dec.result.tokens
    fresh = DynamicCache(config=dec.target.config)
    feed(dec.target, fresh, seen[:-1], observe=False)
    for a, b in zip(dec.tcache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
    n = dec.dcache.length
    torch.testing.assert_close(dec.dcache.layers[0].store_k, fresh.layers[0].keys[:, :, :n], atol=1e-5, rtol=0)


def test_tokens_since_refresh_restarts_at_each_refresh():
    """Refreshing before every other round: each round's recorded tokens_since_refresh (the state its decision saw)
    counts the tokens emitted since the last refresh, that refresh's round included, and restarts there; the
    signal is that count / SINCE_SCALE."""
    dec, controller, prompt, _ = scripted_run()
    res = decode(dec, prompt, script_tokens(), controller)
    emitted = [r.emitted for r in res.rounds]
    last = [max([j for j in range(i) if res.rounds[j].refreshed], default=0) for i in range(len(emitted) + 1)]
    expected = [sum(emitted[last[i]:i]) for i in range(len(emitted) + 1)]
    assert [r.tokens_since_refresh for r in res.rounds] == expected[:-1]
    assert dec.state.tokens_since_refresh == expected[-1] > 0
    assert signals.observe(dec.state)[signals.index("since_refresh")] == np.float32(expected[-1] / signals.SINCE_SCALE)
    assert sum(r.refreshed for r in res.rounds) >= 5 and len(set(expected)) > 3, expected


def test_draft_equal_to_target_accepts_everything_when_sampling():
    target = random_model("llama", seed=0)
    dec = SpeculativeDecoder(target, None, CacheLayout("full"), draft_length=5, temperature=0.8, seed=3)
    res = decode(dec, list(range(30)), 31)
    assert all(r.accepted == r.draft_length for r in res.rounds)
    assert len(res.tokens) == 31


def test_eos_and_max_new_tokens():
    target = random_model("llama", seed=0)
    prompt = list(range(20))
    ref = greedy_reference(target, prompt, 30)
    eos = ref[7]
    res = decode(SpeculativeDecoder(target, None, CacheLayout("full"), eos_token_id=eos), prompt, 30)
    assert res.tokens == ref[: ref.index(eos) + 1]
    for m in (1, 2, 13):
        assert decode(SpeculativeDecoder(target, None, CacheLayout("full")), prompt, m).tokens == ref[:m]


def test_bad_input():
    target = random_model("llama", vocab=128)
    other = random_model("llama", vocab=130)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(target, other)
    with pytest.raises(ValueError, match="draft length"):
        SpeculativeDecoder(target, draft_length=0)
    with pytest.raises(ValueError, match="exceeds"):
        SpeculativeDecoder(target).reset(list(range(100)), 4090)
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeDecoder(target, temperature=-1)


def test_runway_counts_down_while_copying_and_refills_at_a_refresh(testbed_prompt):
    """On the testbed's copy task the draft's copying head reads the source one position further per token, so
    between refreshes the runway signal falls by the tokens each round emits, and a refresh (whose selection
    extends the lookahead past what the queries read) puts it back up. A runway that ignored the selection, or read
    the wrong entry, would not count down token for token."""
    from rift_ada.models import load_pair
    from rift_ada.refresh import PeriodicController

    pair = load_pair("testbed", "testbed")  # the shipped pair: its copier reads far back
    dec = SpeculativeDecoder(pair.target, pair.draft, make_policy("rift-dyn", 256, period=48).layout, 11)
    res = decode(dec, testbed_prompt, 160, PeriodicController(48))
    rounds = res.rounds
    # a.runway is read before round a (which refreshes first if a.refreshed), b.runway after it
    steps = [(a, b) for a, b in zip(rounds, rounds[1:]) if not a.refreshed and a.focus > 0.9 and b.focus > 0.9
             and 0 < b.runway < 64 and 0 < a.runway < 64]
    assert len(steps) >= 4, [(r.runway, r.focus, r.refreshed) for r in rounds]
    assert sum(a.runway - b.runway == a.emitted for a, b in steps) >= 0.75 * len(steps), \
        [(a.runway, b.runway, a.emitted) for a, b in steps]
    after = [b.runway for a, b in zip(rounds, rounds[1:]) if a.refreshed]  # decided right after a refresh
    assert after and min(after) >= 32, after


@pytest.mark.parametrize("step", ["model", "static"])
def test_reused_prefill_decodes_as_a_fresh_one(step, testbed_target, testbed_draft, testbed_prompt):
    """``reuse_prefill``: a second generation of the same prompt starts from a copy of the first one's prefilled
    caches (not re-run) and its rounds equal those after a fresh prefill, sampled and refreshed; another prompt is
    prefilled anew."""
    pol = policy("rift-dyn", budget=256)

    def rounds(dec, prompt):
        res = decode(dec, prompt, 40, pol.controller)
        return res.tokens, [(r.position, r.accepted, r.refreshed) for r in res.rounds]

    fresh = SpeculativeDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11, temperature=1.0, seed=3,
                               draft_step=step, verify_step=step)
    want = rounds(fresh, testbed_prompt)
    dec = SpeculativeDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11, temperature=1.0, seed=3,
                             draft_step=step, verify_step=step)
    dec.reuse_prefill = True
    assert rounds(dec, testbed_prompt) == want
    kept = dec._prefilled[2][1]
    assert rounds(dec, testbed_prompt) == want and dec._prefilled[2][1] is kept  # copied from, never decoded on
    assert rounds(dec, testbed_prompt) == want
    other = testbed_prompt[:-100]
    assert rounds(dec, other) == rounds(fresh, other) and dec._prefilled[2][1] is not kept
