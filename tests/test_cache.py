import pytest
import torch
from transformers import DynamicCache

from rift_ada.attention import use_rift_attention
from rift_ada.cache import RiftCache
from rift_ada.layout import CacheLayout
from rift_ada.policies import make_policy
from rift_ada.scorers import SCORERS, SnapKVScorer, make_scorer, pool_scores, window_attention
from rift_ada.selection import select_importance
from tests.conftest import feed, layout_of, random_model


# The smallest budget at which no forward below misses a token: 60 prompt tokens, then rounds of 3. Each query at
# position i sees the importance part and the window band [i - window, i], so the last query (71) reaches position 0
# with a window of 71; `window` keeps 4 sinks and budget - 4 recent tokens, so its band need only reach position 4
# (67 + 4 = 71). snapkv never evicts while decoding, so its budget only has to hold the prompt. One token less anywhere
# and the logits differ (test_one_token_less_differs).
TIGHT = {"rift-stat": dict(budget=71, window=71), "rift-dyn": dict(budget=71, window=71), "snapkv": dict(budget=60),
         "window": dict(budget=71)}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", list(TIGHT))
def test_tight_budget_holding_everything_equals_dense(arch, policy):
    model = random_model(arch, init=0.02)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (60,), generator=g).tolist()
    steps = torch.randint(0, 128, (12,), generator=g).tolist()
    dense, rift = DynamicCache(config=model.config), RiftCache(2, layout_of(policy, **TIGHT[policy]))
    torch.testing.assert_close(feed(model, rift, prompt), feed(model, dense, prompt, False), atol=1e-5, rtol=0)
    rift.compress()
    assert rift.active_tokens() == 60
    for i in range(0, 12, 3):  # multi-token forwards over the cache exercise the mask sizes
        out_r, out_d = feed(model, rift, steps[i:i + 3]), feed(model, dense, steps[i:i + 3], False)
        torch.testing.assert_close(out_r, out_d, atol=1e-5, rtol=0)
        if policy == "rift-dyn":
            rift.refresh()
        rift.rollback(0)


@pytest.mark.parametrize("policy", list(TIGHT))
def test_one_token_less_differs(policy):
    """The TIGHT budgets are the smallest: one token less and the last round's logits differ from dense. For rift
    and window this is the per-query window band: mid-round the cache still stores the evicted-to-be tokens, but the
    last query may not see them."""
    model = random_model("llama", init=0.02)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (60,), generator=g).tolist()
    steps = torch.randint(0, 128, (12,), generator=g).tolist()
    less = {k: v - 1 for k, v in TIGHT[policy].items()}
    dense, rift = DynamicCache(config=model.config), RiftCache(2, layout_of(policy, **less))
    feed(model, rift, prompt), feed(model, dense, prompt, False)
    rift.compress()
    for i in range(0, 12, 3):
        out_r, out_d = feed(model, rift, steps[i:i + 3]), feed(model, dense, steps[i:i + 3], False)
        rift.rollback(0)
    assert (out_r - out_d).abs().max() > 1e-3


def forward_at(model, cache, tokens, start):
    """A forward of ``tokens`` at logical positions ``start...`` over a cache holding fewer entries than that."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), cache=cache, position_ids=torch.arange(start, start + len(tokens))[None],
                     ).logits[0]


@pytest.mark.parametrize("name", ["window", "rift-stat"])
def test_eviction_keeps_exactly_the_layout_positions(name):
    """Budget 24 against 60 prompt + 12 generated tokens, so eviction really happens. After every round the cache
    holds exactly the positions its layout names (window: 4 sinks + the last 20; rift-stat with key-norm scores: the
    12 lowest-key-norm prompt positions before the window, per KV head, + the last 12), and its logits equal a
    reference attending to exactly those positions, built here from the full history."""
    model = random_model("llama", init=0.02)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 128, (60,), generator=g).tolist()
    steps = torch.randint(0, 128, (12,), generator=g).tolist()
    policy = layout_of("window", 24) if name == "window" else layout_of("rift-stat", 24, scorer="keynorm")
    imp, window = (4, 20) if name == "window" else (12, 12)
    rift, dense = RiftCache(2, policy), DynamicCache(config=model.config)
    feed(model, rift, prompt)
    feed(model, dense, prompt, False)
    rift.compress()
    history = [[layer.keys, layer.values] for layer in dense.layers]  # per layer, every position's key and value

    def expected(layer_idx, length):
        k = history[layer_idx][0]
        if name == "window":
            sel = torch.arange(imp).expand(1, k.shape[1], -1)
        else:  # the importance part is chosen once, from the prompt positions before the window
            sel = k[:, :, :60 - window].norm(dim=-1).topk(imp, largest=False).indices.sort(-1).values
        return torch.cat([sel, torch.arange(length - window, length).expand(1, k.shape[1], -1)], -1)

    length = 60
    for i in range(0, 12, 3):
        for li, layer in enumerate(rift.layers):
            assert torch.equal(layer.active_positions(), expected(li, length)), (li, length)
        # The reference feeds the round's tokens one by one; token j sees the selection and the window band
        # [length + j - window, length + j]: the round's older tail entries drop out of its view.
        new_kv, outs = [[None, None] for _ in range(2)], []
        for j in range(3):
            ref = DynamicCache(config=model.config)
            for li in range(2):
                pos = expected(li, length)  # the window's oldest j entries are out of its reach
                pos = torch.cat([pos[..., :imp], pos[..., imp + j:]], -1)
                idx = pos[..., None].expand(-1, -1, -1, history[li][0].shape[-1])
                kv = [h.gather(2, idx) for h in history[li]]
                if j:
                    kv = [torch.cat([a, b], 2) for a, b in zip(kv, new_kv[li])]
                ref.update(kv[0], kv[1], li)
            outs.append(forward_at(model, ref, steps[i + j:i + j + 1], length + j))
            for li in range(2):  # this token's key and value, as computed on the compressed cache
                new_kv[li] = [ref.layers[li].keys[:, :, -(j + 1):], ref.layers[li].values[:, :, -(j + 1):]]
        out = feed(model, rift, steps[i:i + 3])
        torch.testing.assert_close(out, torch.cat(outs), atol=1e-5, rtol=0)
        assert (out - feed(model, dense, steps[i:i + 3], False)).abs().max() > 1e-4, "eviction changes the output"
        for li in range(2):
            history[li] = [torch.cat([h, new], 2) for h, new in zip(history[li], new_kv[li])]
        rift.rollback(0)
        length += 3
        assert rift.active_tokens() == 24


class FixedScorer:
    """A scorer with known scores, to check what selection does with them."""
    name, needs_queries = "fixed", False

    def __init__(self, scores):
        self.scores = scores

    def score(self, queries, keys, query_positions, key_positions):
        return self.scores


@pytest.mark.parametrize("name", ["window", "rift-stat"])
def test_prompt_shorter_than_the_budget_keeps_its_oldest_positions(name):
    """A 60-token prompt under a budget of 72: the importance part takes the oldest positions (the window policy's
    4 sinks among them), so once generation fills the budget the cache holds them and the newest tokens, not a
    plain sliding window that has evicted the sinks."""
    model = random_model("llama", init=0.02)
    use_rift_attention(model)
    policy = layout_of(name, 72, scorer="keynorm")
    rift = RiftCache(2, policy)
    feed(model, rift, list(range(1, 61)))
    rift.compress()
    for _ in range(20):
        feed(model, rift, [5])
        rift.rollback(0)
    imp = 4 if name == "window" else 36
    pos = rift.layers[0].active_positions()[0, 0]
    assert rift.active_tokens() == 72
    assert pos[:imp].tolist() == list(range(imp)) and pos[imp:].tolist() == list(range(80 - (72 - imp), 80))


def test_selection_keeps_the_best_scored_positions_per_head():
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(1, 2, 40, generator=g)
    scores[..., 30:] += 100  # the last 10 score best but lie in the window, which holds them anyway
    keys = torch.randn(1, 2, 40, 8, generator=g)
    pos = select_importance(FixedScorer(scores), keys, 40, n_imp=6, tail_keep=10)
    for h in range(2):
        best = sorted(scores[0, h, :30].argsort(descending=True)[:6].tolist())
        assert pos[0, h].tolist() == best, h
    assert not torch.equal(pos[0, 0], pos[0, 1])


def test_active_cache_is_bounded_and_rollback_is_exact():
    model = random_model("llama", init=0.02)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 128, (200,), generator=g).tolist()
    pol = layout_of("rift-dyn", 64)
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
    a.rollback(0)
    assert a.active_tokens() == 64
    with pytest.raises(RuntimeError, match="cannot roll back"):
        a.crop(-40)  # past the tail: those tokens were evicted


def test_per_head_selection_and_refresh_reaches_generated_tokens():
    model = random_model("llama", init=0.05)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(3)
    cache = RiftCache(2, layout_of("rift-dyn", 48))
    feed(model, cache, torch.randint(0, 128, (150,), generator=g).tolist())
    cache.compress()
    layer = cache.layers[0]
    pos = layer.active_positions()
    assert pos.shape == (1, 2, 48)
    assert (pos[..., :24] < 150 - 24).all() and torch.equal(pos[0, 0, 24:], torch.arange(126, 150))
    assert not torch.equal(pos[0, 0, :24], pos[0, 1, :24]), "KV heads select independently"
    for t in torch.randint(0, 128, (100,), generator=g).tolist():
        feed(model, cache, [t])
        cache.rollback(0)
    before = layer.active_positions()
    assert before[0, 0, :24].max() < 150, "rift-stat style: selection stays on the prompt"
    cache.refresh()
    after = layer.active_positions()
    assert after[..., :24].max() >= 150, "a refresh can select generated tokens that left the window"
    assert torch.equal(after[..., 24:], before[..., 24:]), "the window is untouched"
    # The active entries are the stored keys of those positions.
    torch.testing.assert_close(layer.keys[0, 1, :24], layer.store_k[0, 1, after[0, 1, :24]])


def rescored_from_scratch(cache: RiftCache) -> RiftCache:
    """A new cache given ``cache``'s backing store and observation queries, then compressed: what scoring that
    history from nothing selects (the layout's window must equal ``cache``'s tail)."""
    fresh = RiftCache(len(cache.layers), cache.layout)
    for new, old in zip(fresh.layers, cache.layers):
        new.update(old.store_k.clone(), old.store_v.clone())
        new.observe(old.queries.clone(), old.query_pos.clone())
    fresh.compress()
    return fresh


RIFT_STATE = ("keys", "values", "store_k", "store_v", "imp_pos", "queries", "query_pos")


def test_refresh_on_a_grid_scores_the_history_of_its_last_grid_point():
    """refresh_grid 8: after 150 prompt and 61 generated tokens a refresh scores the history as it stood at 206 (150 +
    7 x 8): layer 0 (whose keys and queries do not depend on the cache) selects what a cache prefilled with those 206
    tokens and compressed selects, while the window stays the newest 24; refreshing with grid 1 selects otherwise."""
    model = random_model("llama", init=0.05)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(6)
    history = torch.randint(0, 128, (211,), generator=g).tolist()
    caches = {}
    for grid in (1, 8):
        cache = RiftCache(2, layout_of("rift-dyn", 48, obs_window=8, refresh_grid=grid))
        feed(model, cache, history[:150])
        cache.compress()
        for t in history[150:]:
            feed(model, cache, [t])
            cache.rollback(0)
        assert cache.refresh_point() == (211 if grid == 1 else 206)
        cache.refresh()
        caches[grid] = cache
    prefilled = RiftCache(2, layout_of("rift-dyn", 48, obs_window=8))
    feed(model, prefilled, history[:206])
    prefilled.compress()
    layer = caches[8].layers[0]
    assert torch.equal(layer.imp_pos, prefilled.layers[0].imp_pos)
    assert torch.equal(layer.active_positions()[..., layer.n_imp:], torch.arange(211 - 24, 211).expand(1, 2, -1))
    assert not torch.equal(layer.imp_pos, caches[1].layers[0].imp_pos)
    with pytest.raises(ValueError, match=r"refresh grid must be an integer in \[1, 64\]"):
        layout_of("rift-dyn", 48, refresh_grid=65)


def test_refresh_scores_from_scratch_resets_drift_and_rolls_back_exactly():
    """rift-dyn budget 48 (24 selected + a window of 24), observation window 8: 150 prompt tokens, then 60 tokens one
    a forward, as the draft feeds them. A refresh selects what a from-scratch scoring of the same history selects
    (every layer: a new cache given the backing store and the same queries; layer 0, whose keys and queries do not
    depend on the cache: a new cache prefilled with all 210 tokens), and the drift restarts at 0. A round after the
    refresh that feeds 4 tokens and rejects 3 leaves the cache bit for bit as if only the kept one had been fed."""
    model = random_model("llama", init=0.05)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(6)
    history = torch.randint(0, 128, (210,), generator=g).tolist()
    layout = layout_of("rift-dyn", 48, obs_window=8)
    cache = RiftCache(2, layout)
    feed(model, cache, history[:150])
    cache.compress()
    assert cache.query_drift() < 1e-6, "compression is a scoring: the drift starts at 0"
    for t in history[150:]:
        feed(model, cache, [t])
        cache.rollback(0)
    before = [layer.imp_pos.clone() for layer in cache.layers]
    drift = cache.query_drift()
    assert drift > 0.05, drift  # else a refresh that forgot to reset it would pass

    cache.refresh()
    assert cache.query_drift() < 1e-6, f"the drift after a refresh is {cache.query_drift():.3f}, not 0"
    fresh = rescored_from_scratch(cache)
    prefilled = RiftCache(2, layout)
    feed(model, prefilled, history)
    prefilled.compress()
    for ours, scratch in zip(cache.layers, fresh.layers):
        assert torch.equal(ours.imp_pos, scratch.imp_pos) and torch.equal(ours.keys, scratch.keys)
    assert torch.equal(cache.layers[0].imp_pos, prefilled.layers[0].imp_pos)
    assert any(not torch.equal(b, layer.imp_pos) for b, layer in zip(before, cache.layers)), "the refresh moved"

    kept = cache.clone()
    fed = torch.randint(0, 128, (4,), generator=g).tolist()
    for t in fed:
        feed(model, cache, [t])
    cache.rollback(3)
    feed(model, kept, fed[:1])
    kept.rollback(0)
    for a, b in zip(cache.layers, kept.layers):
        assert a.length == b.length == 211 and a.n_imp == b.n_imp == 24
        for name in RIFT_STATE:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert cache.query_drift() == kept.query_drift()


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


def test_policy_and_layout_errors():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lru", budget=10)
    with pytest.raises(ValueError, match="unknown cache layout"):
        CacheLayout("lru", budget=10)
    with pytest.raises(ValueError, match="needs a budget"):
        make_policy("rift-stat")
    with pytest.raises(ValueError, match="sliding window"):
        make_policy("rift-stat", budget=10, window=20)
    with pytest.raises(ValueError, match="attention sinks"):
        make_policy("window", budget=3)
    with pytest.raises(ValueError, match="period"):
        make_policy("rift-dyn", budget=64)
    with pytest.raises(ValueError, match="only applies to --policy rift-dyn"):
        make_policy("rift-stat", budget=64, period=8)
    with pytest.raises(ValueError, match="needs --controller"):
        make_policy("rift-ada", budget=64)
    with pytest.raises(ValueError, match="periodic:N"):
        make_policy("rift-ada", budget=64, controller="periodic:x")
    with pytest.raises(ValueError, match="unknown scorer"):
        make_policy("rift-stat", budget=64, scorer="h2o")
    with pytest.raises(RuntimeError, match="cannot refresh"):
        RiftCache(1, layout_of("rift-stat", 64)).refresh()
    # An option the scorer does not take is refused, by name, not dropped.
    with pytest.raises(ValueError, match="scorer 'snapkv' has no option 'kernal'; its options: kernel, pooling"):
        make_scorer("snapkv", kernal=5)
    with pytest.raises(ValueError, match="scorer 'tova' has no option 'kernel'"):
        CacheLayout("rift", 64, scorer="tova", scorer_options=(("kernel", 7),))
    assert make_scorer("snapkv", kernel=5, pooling="avg").kernel == 5


def test_layout_split_is_integer_and_frozen():
    lay = CacheLayout("rift", budget=101, window_fraction=0.3)
    assert (lay.n_imp, lay.tail_keep, lay.tail_limit) == (71, 30, 30)
    assert CacheLayout("rift", budget=64, window=10).n_imp == 54
    assert (CacheLayout("window", budget=64).n_imp, CacheLayout("window", budget=64).tail_keep) == (4, 60)
    assert CacheLayout("snapkv", budget=64).tail_limit is None and not CacheLayout("full").compress
    with pytest.raises(Exception):
        lay.budget = 5  # frozen: the cache's layout cannot change under it
    assert make_policy("rift-dyn", 64, period=8).layout == make_policy("rift-ada", 64, controller="periodic:8").layout


def test_read_ahead_finds_the_sharpest_read_and_the_run_after_it():
    """One RIFT layer with 2 KV heads (1 query head each) whose importance part keeps positions 10-19 and 40-44 (head
    0) and 10-19 and 95-99 (head 1) of a 110-token history, window 100-109. Query head 0 points sharply at the key of
    position 15: focus ~1 and runway 4 (16..19 kept, 20 not). Pointing at 42 gives 2; pointing head 1 at 97, whose
    block runs into the window (98, 99, then the window from 100), gives the cap. Diffuse queries: focus ~1/n."""
    from rift_ada.cache import RiftLayer

    d, length = 8, 110
    imp = torch.tensor([list(range(10, 20)) + list(range(40, 45)), list(range(10, 20)) + list(range(95, 100))])
    layer = RiftLayer(True, None, obs_window=4)
    tail = torch.zeros(1, 2, 10, d)
    g = torch.Generator().manual_seed(0)
    imp_keys = torch.randn(1, 2, 15, d, generator=g)
    layer.update(torch.cat([imp_keys, tail], dim=2), torch.zeros(1, 2, 25, d))
    layer.n_imp, layer.length, layer.imp_pos = 15, length, imp[None]

    def query(head, entry):  # a query that picks importance entry `entry` of KV head `head` (50x its key)
        q = torch.zeros(1, 2, 1, d)
        q[0, head, 0] = 50 * imp_keys[0, head, entry]
        return q

    layer.queries = query(0, 5)  # head 0 -> position 15
    focus, runway = layer.read_ahead(64)
    assert focus > 0.99 and runway == 4
    layer.queries = query(0, 12)  # position 42: 43, 44 kept
    assert layer.read_ahead(64)[1] == 2
    layer.queries = query(1, 12)  # head 1, position 97: 98, 99 kept, then the window
    assert layer.read_ahead(64)[1] == 64
    assert layer.read_ahead(8)[1] == 8
    layer.queries = torch.zeros(1, 2, 1, d)  # uniform attention over 25 active entries
    assert layer.read_ahead(64)[0] == pytest.approx(1 / 25)


def test_backing_store_appends_in_place_and_crops_by_length():
    """The store is a preallocated buffer: 3,000 one-token appends after a 1,024-token prefill reallocate it a few
    times (geometric growth), not once per token, and it always reads back every token fed, in order, rollbacks
    included."""
    from rift_ada.cache import RiftLayer

    layer = RiftLayer(keep_store=True, store_device=None, obs_window=8)
    g = torch.Generator().manual_seed(0)
    fed = [torch.randn(1, 2, 1024, 4, generator=g)]
    layer.update(fed[0], fed[0] + 1)
    buffers = {layer._store_k.data_ptr()}
    for i in range(3000):
        kv = torch.randn(1, 2, 1, 4, generator=g)
        layer.update(kv, kv + 1)
        fed.append(kv)
        if i % 7 == 6:  # a rejected token: dropped from the store, later overwritten
            layer.crop(-1)
            fed.pop()
        buffers.add(layer._store_k.data_ptr())
    expected = torch.cat(fed, dim=-2)
    assert layer.store_len == layer.length == expected.shape[-2]
    assert torch.equal(layer.store_k, expected) and torch.equal(layer.store_v, expected + 1)
    assert len(buffers) <= 6, f"{len(buffers)} reallocations"
    assert layer._store_k.shape[-2] < 1.5 * layer.store_len, "growth overshoots by at most a quarter (or a chunk)"
