"""The engine-side drafting pool (rift_ada.proposer) against rift-ada's own decoder, with no engine installed: a
small engine written here verifies with the real target (a whole-context forward: no cache to get wrong), runs
requests that arrive and finish at different steps in shuffled batch slots, and the pool must draft exactly what
``SpeculativeDecoder`` drafts, round for round, under every RIFT policy."""

import numpy as np
import pytest
import torch

from conftest import cached_testbed_pair, train_prompts
from rift_ada.evaluate import decode
from rift_ada.policies import make_policy
from rift_ada.proposer import DraftPool
from rift_ada.refresh import ThresholdController
from rift_ada.speculative import SpeculativeDecoder

K = 11


def engine(target, pool, prompts, max_new, arrive, seed=0):
    """Greedy speculative decoding as an engine runs it: each step the live requests, in an order that changes, hand
    their verified contexts to ``pool.propose``; each request verifies its drafts (trimmed to what its
    max_new_tokens leaves, as rift-ada's rounds are) and keeps the agreeing prefix plus the target's token. Request
    i joins at step ``arrive[i]``. Returns each request's generated tokens and per-round accepted counts."""
    rng = np.random.default_rng(seed)
    live, out, accepted = {}, {}, {i: [] for i in range(len(prompts))}
    step = 0
    while len(out) < len(prompts):
        for i, p in enumerate(prompts):
            if arrive[i] == step:
                with torch.no_grad():
                    live[i] = list(p) + [int(target(torch.tensor([p])).logits[0, -1].argmax())]
        order = list(live)
        rng.shuffle(order)
        drafts = pool.propose([live[i] for i in order]) if order else []
        for i, d in zip(order, drafts):
            ctx = live[i]
            d = d[:max_new - (len(ctx) - len(prompts[i])) - 1]
            with torch.no_grad():
                greedy = target(torch.tensor([ctx + d])).logits[0, len(ctx) - 1:].argmax(-1).tolist()
            n = next((j for j in range(len(d)) if d[j] != greedy[j]), len(d))
            ctx += d[:n] + [greedy[n]]
            accepted[i].append(n)
            if len(ctx) - len(prompts[i]) >= max_new:
                out[i] = ctx[len(prompts[i]):]
                del live[i]
        step += 1
    return out, accepted


def runway_rule(tmp_path):
    """An exported rift-ada controller reading several signals (a rule file, loaded as the proposer loads one)."""
    path = tmp_path / "controller.json"
    ThresholdController([("runway", "<", 0.1), ("acc_mean", "<", 0.4), ("drift_rise", ">", 0.3)], min_gap=8).save(path)
    return str(path)


@pytest.mark.parametrize("name", ["rift-stat", "rift-dyn", "rift-ada", "full"])
def test_pool_drafts_what_the_decoder_drafts(name, tmp_path):
    pair = cached_testbed_pair("testbed")
    prompts = [list(p)[:200 + 90 * i] for i, p in enumerate(train_prompts(3, 512))]
    policy = make_policy(name, None if name == "full" else 96, period=24 if name == "rift-dyn" else None,
                         controller=runway_rule(tmp_path) if name == "rift-ada" else None)
    max_new = 70
    pool = DraftPool(pair.draft, policy.layout, policy.controller, K, max_new_tokens=max_new)
    out, accepted = engine(pair.target, pool, prompts, max_new, arrive=[0, 3, 5])
    dec = SpeculativeDecoder(pair.target, pair.draft, policy.layout, K)
    for i, p in enumerate(prompts):
        ref = decode(dec, p, max_new, policy.controller)
        assert out[i] == ref.tokens, f"{name}: request {i}'s output differs from the decoder's"
        assert accepted[i] == [r.accepted for r in ref.rounds], f"{name}: request {i} accepted differently"
    if name in ("rift-dyn", "rift-ada"):
        assert pool.stats.refreshes == sum(r.refreshed for p in prompts for r in decode(dec, p, max_new,
                                                                                         policy.controller).rounds)
        assert pool.stats.refreshes > 0
    assert pool.sequences == [] or len(pool.sequences) == 1  # only the last request to finish can still be held
    assert pool.stats.prefills == 3 and pool.stats.peak_live == 3


def test_pool_holds_budget_per_live_request_and_forgets_finished_ones():
    pair = cached_testbed_pair("testbed")
    prompts = [list(p) for p in train_prompts(2, 512)]
    policy = make_policy("rift-dyn", 64, period=16)
    pool = DraftPool(pair.draft, policy.layout, policy.controller, 4)
    ctx = [p + [7] for p in prompts]
    pool.propose(ctx)
    per_token = pair.draft.config.num_hidden_layers * 2 * pair.draft.config.num_key_value_heads * \
        pair.draft.config.head_dim * 4
    assert len(pool.sequences) == 2
    for s in pool.sequences:  # importance + window + the round in flight (k - 1 drafts and the pending token)
        assert s.cache.active_bytes() <= (64 + 4) * per_token
    pool.propose([ctx[1] + [3]])  # request 0 is gone from the batch: finished
    assert len(pool.sequences) == 1 and pool.sequences[0].prompt_len == len(prompts[1])
    assert pool.propose([None, []]) == [[], []]  # rows still prefilling draft nothing
    assert pool.sequences == []


def test_two_requests_with_one_prompt_each_keep_a_cache():
    pair = cached_testbed_pair("testbed")
    p = list(train_prompts(1, 512)[0]) + [5]
    pool = DraftPool(pair.draft, make_policy("rift-stat", 64).layout, None, 3)
    a, b = pool.propose([p, p])
    assert a == b and len(pool.sequences) == 2
    # they part: one accepted its drafts, the other took another token
    pool.propose([p + a + [1], p + [(a[0] + 1) % 1024]])
    assert len(pool.sequences) == 2 and sorted(len(s.context) for s in pool.sequences) == [len(p) + 1, len(p) + 4]


def test_pool_refuses_in_one_line():
    pair = cached_testbed_pair("testbed")
    stat = make_policy("rift-stat", 64)
    with pytest.raises(ValueError, match="needs a refreshable cache"):
        DraftPool(pair.draft, stat.layout, make_policy("rift-dyn", 64, period=8).controller)
    with pytest.raises(ValueError, match="draft length"):
        DraftPool(pair.draft, stat.layout, None, 0)
    pool = DraftPool(pair.draft, stat.layout, None, 3)
    with pytest.raises(ValueError, match="prompt and the engine's first token"):
        pool.propose([[5]])
