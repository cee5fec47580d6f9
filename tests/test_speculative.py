import pytest
import torch
from transformers import DynamicCache

from rift_ada import signals
from rift_ada.data import build_tasks, encode
from rift_ada.layout import CacheLayout
from rift_ada.models import greedy_reference
from rift_ada.policies import POLICIES, make_policy
from rift_ada.scorers import SCORERS
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import random_model


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
    res = dec.generate(testbed_prompt, 40, pol.controller)
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
        assert dec.generate(testbed_prompt, 40, pol.controller).tokens == reference


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
            res = SpeculativeDecoder(target, d, pol.layout, draft_length=k).generate(prompt, 48, pol.controller)
            assert res.tokens == reference, (d is None, k)


def test_rollback_leaves_caches_as_if_never_fed(testbed_target, testbed_draft, testbed_prompt):
    # Budget 64: the draft errs often, so rounds end in every way (all accepted, some fed drafts rejected, none).
    pol = policy("rift-dyn", budget=64)
    dec = SpeculativeDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11)
    dec.reset(testbed_prompt, 64)
    while not dec.done:
        dec.step(pol.controller.decide(signals.observe(dec.state)))
        seen = testbed_prompt + dec.result.tokens
        assert dec.tcache.get_seq_length() == len(seen) - 1
        assert dec.dcache.length == len(seen) - len(dec._d_pending)
    ends = {"all" if r.accepted == r.draft_length else "none" if r.accepted == 0 else "some"
            for r in dec.result.rounds}
    assert ends == {"all", "some", "none"}, ends
    # The target cache equals a fresh prefill of the accepted tokens; the draft's backing store too.
    fresh_t = DynamicCache(config=testbed_target.config)
    ids = torch.tensor([seen[:-1]])
    with torch.no_grad():
        testbed_target(ids, cache=fresh_t, position_ids=torch.arange(ids.shape[1])[None])
    for a, b in zip(dec.tcache.layers, fresh_t.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
    n = dec.dcache.length
    fresh_d = DynamicCache(config=testbed_draft.config)
    with torch.no_grad():
        testbed_draft(ids[:, :n], cache=fresh_d, position_ids=torch.arange(n)[None])
    # Only the prompt part is computed densely in the draft; later tokens saw a compressed cache.
    L = len(testbed_prompt)
    for a, b in zip(dec.dcache.layers, fresh_d.layers):
        assert a.store_k.shape[2] == n
        torch.testing.assert_close(a.store_k[:, :, :L], b.keys[:, :, :L], atol=1e-5, rtol=0)


def test_draft_equal_to_target_accepts_everything_when_sampling():
    target = random_model("llama", seed=0)
    dec = SpeculativeDecoder(target, None, CacheLayout("full"), draft_length=5, temperature=0.8, seed=3)
    res = dec.generate(list(range(30)), 31)
    assert all(r.accepted == r.draft_length for r in res.rounds)
    assert len(res.tokens) == 31


def test_eos_and_max_new_tokens():
    target = random_model("llama", seed=0)
    prompt = list(range(20))
    ref = greedy_reference(target, prompt, 30)
    eos = ref[7]
    res = SpeculativeDecoder(target, None, CacheLayout("full"), eos_token_id=eos).generate(prompt, 30)
    assert res.tokens == ref[: ref.index(eos) + 1]
    for m in (1, 2, 13):
        assert SpeculativeDecoder(target, None, CacheLayout("full")).generate(prompt, m).tokens == ref[:m]


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
