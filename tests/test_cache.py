import pytest
import torch
from transformers import DynamicCache

from rift_ada.attention import use_rift_attention
from rift_ada.cache import RiftCache
from rift_ada.policies import CachePolicy
from rift_ada.scorers import SCORERS, SnapKVScorer, make_scorer, pool_scores, window_attention
from tests.conftest import feed, random_model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", ["rift-stat", "rift-dyn", "snapkv", "window"])
def test_budget_at_least_length_equals_dense(arch, policy):
    model = random_model(arch, init=0.02)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (60,), generator=g).tolist()
    steps = torch.randint(0, 128, (12,), generator=g).tolist()
    dense, rift = DynamicCache(config=model.config), RiftCache(2, CachePolicy(policy, budget=1000, period=4))
    torch.testing.assert_close(feed(model, rift, prompt), feed(model, dense, prompt, False), atol=1e-5, rtol=0)
    rift.compress()
    assert rift.active_tokens() == 60
    for i in range(0, 12, 3):  # multi-token forwards over the cache exercise the mask sizes
        out_r, out_d = feed(model, rift, steps[i:i + 3]), feed(model, dense, steps[i:i + 3], False)
        torch.testing.assert_close(out_r, out_d, atol=1e-5, rtol=0)
        if policy == "rift-dyn":
            rift.refresh()
        rift.compact()


def test_active_cache_is_bounded_and_rollback_is_exact():
    model = random_model("llama", init=0.02)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 128, (200,), generator=g).tolist()
    pol = CachePolicy("rift-dyn", budget=64, period=8)
    a, b = RiftCache(2, pol), RiftCache(2, pol)
    feed(model, a, prompt)
    feed(model, b, prompt)
    for cache in (a, b):
        cache.compress()
        assert cache.active_tokens() == 64
    extra = torch.randint(0, 128, (6,), generator=g).tolist()
    feed(model, a, extra)  # two accepted + four rejected ...
    a.crop(-4)
    feed(model, b, extra[:2])  # ... is the same as feeding only the two
    for la, lb in zip(a.layers, b.layers):
        assert la.length == lb.length == 202 and la.n_active == lb.n_active and la.n_imp == lb.n_imp
        torch.testing.assert_close(la.keys, lb.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(la.store_v, lb.store_v, atol=1e-6, rtol=0)
        assert torch.equal(la.active_positions(), lb.active_positions())
        assert torch.equal(la.query_pos, lb.query_pos) and la.query_pos.max() == 201
        torch.testing.assert_close(la.queries, lb.queries, atol=1e-6, rtol=0)
    a.compact()
    assert a.active_tokens() == 64
    with pytest.raises(RuntimeError, match="cannot roll back"):
        a.crop(-40)  # past the tail: those tokens were evicted


def test_per_head_selection_and_refresh_reaches_generated_tokens():
    model = random_model("llama", init=0.05)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(3)
    cache = RiftCache(2, CachePolicy("rift-dyn", budget=48, period=8))
    feed(model, cache, torch.randint(0, 128, (150,), generator=g).tolist())
    cache.compress()
    layer = cache.layers[0]
    pos = layer.active_positions()
    assert pos.shape == (1, 2, 48)
    assert (pos[..., :24] < 150 - 24).all() and torch.equal(pos[0, 0, 24:], torch.arange(126, 150))
    assert not torch.equal(pos[0, 0, :24], pos[0, 1, :24]), "KV heads select independently"
    for t in torch.randint(0, 128, (100,), generator=g).tolist():
        feed(model, cache, [t])
        cache.compact()
    before = layer.active_positions()
    assert before[0, 0, :24].max() < 150, "rift-stat style: selection stays on the prompt"
    cache.refresh()
    after = layer.active_positions()
    assert after[..., :24].max() >= 150, "a refresh can select generated tokens that left the window"
    assert torch.equal(after[..., 24:], before[..., 24:]), "the window is untouched"
    # The active entries are the stored keys of those positions.
    torch.testing.assert_close(layer.keys[0, 1, :24], layer.store_k[0, 1, after[0, 1, :24]])


def test_scorer_contract_shapes_and_causality():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 8, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    qpos, kpos = torch.arange(22, 30), torch.arange(30)
    for name in SCORERS:
        s = make_scorer(name).score(q, k, qpos, kpos)
        assert s.shape == (1, 2, 30), name
    att = window_attention(q, k, qpos, kpos)
    # Mean of softmax rows: each (query head, query) row sums to 1, so per KV head the total is 1.
    torch.testing.assert_close(att.sum(-1), torch.ones(1, 2))
    # The last key is visible only to the last query: 1/8 of one row's mass at most.
    assert (att[..., 29] <= 1 / 8 + 1e-6).all()
    only_first = window_attention(q[:, :, :1], k, qpos[:1], kpos)
    assert (only_first[..., 23:] == 0).all(), "a query never attends to later keys"


def test_pooling_keeps_length_and_edges():
    s = torch.zeros(1, 1, 10)
    s[..., 0] = 1.0
    assert pool_scores(s, 7, "max")[0, 0, :4].eq(1).all()
    avg = pool_scores(torch.ones(1, 1, 10), 5, "avg")
    torch.testing.assert_close(avg, torch.ones(1, 1, 10)), "no zero-padding deflation at the edges"
    with pytest.raises(ValueError):
        SnapKVScorer(pooling="median")


def test_lookahead_extends_scores_forward_only():
    from rift_ada.scorers.base import extend_forward

    s = torch.zeros(1, 1, 12)
    s[..., 3] = 1.0
    out = extend_forward(s, 4)
    assert torch.equal(out[0, 0, :3], torch.zeros(3)), "nothing before the attended key"
    assert out[0, 0, 3] == 1.0 and (out[0, 0, 4:8] > 0.5 - 1e-6).all() and (out[0, 0, 4:8].diff() < 0).all()
    assert (out[0, 0, 8:] == 0).all(), "nothing beyond the radius"
    torch.testing.assert_close(extend_forward(s, 0), s)


def test_policy_errors():
    with pytest.raises(ValueError, match="unknown policy"):
        CachePolicy("lru", budget=10)
    with pytest.raises(ValueError, match="needs a budget"):
        CachePolicy("rift-stat")
    with pytest.raises(ValueError, match="sliding window"):
        CachePolicy("rift-stat", budget=10, window=20)
    with pytest.raises(ValueError, match="attention sinks"):
        CachePolicy("window", budget=3)
    with pytest.raises(ValueError, match="period"):
        CachePolicy("rift-dyn", budget=64)
    with pytest.raises(ValueError, match="unknown scorer"):
        CachePolicy("rift-stat", budget=64, scorer="h2o")
    with pytest.raises(RuntimeError, match="cannot refresh"):
        RiftCache(1, CachePolicy("rift-stat", budget=64)).refresh()
