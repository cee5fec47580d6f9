"""The architecture matrix: every family of ``rift_ada.architectures.FAMILIES`` as a tiny random-init model.

Greedy speculative output must equal the target's own ``generate`` for self-speculation and for an external draft of
another family, with full, rift-stat and rift-dyn draft caches and k in {1, 4, 11}. Prompts (80 tokens) are longer
than every sliding window (16), so the target's sliding layers roll back after their window is full, and the draft's
RIFT budget (24) compresses its full-attention layers. Greedy equality checks the target side; the draft side (its
sliding layers keep the model's window) is checked by self-speculation on a full draft cache, which must accept every
draft, and by logits against the model's own cache. Hybrid families (Qwen3.5, Nemotron-H) run here too; their
linear-attention states are checked in tests/test_hybrid.py.
"""

import functools
import runpy
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from rift_ada.architectures import FAMILIES, UnsupportedModelError, family
from rift_ada.attention import check_observable, observer_for
from rift_ada.cache import RiftCache, SlidingLayer
from rift_ada.evaluate import decode, evaluate
from rift_ada.layout import CacheLayout
from rift_ada.models import greedy_reference
from rift_ada.policies import make_policy
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import (SCRIPT, SCRIPT_K, decode_checking_rollback, feed, recompute, script_tokens,
                            scripted_draft)
from tests.test_sampling import VOCAB, check_rift_dyn_sampling

ROOT = Path(__file__).resolve().parents[1]
KEYS = [f.key for f in FAMILIES]
WINDOW, PROMPT, NEW, BUDGET = 16, 80, 32, 24


@functools.lru_cache(maxsize=None)
def target(key):
    return family(key).model(seed=0, window=WINDOW)


@functools.lru_cache(maxsize=None)
def external_draft(key):
    """A 2-layer draft of the next family in the list: another architecture, the same vocabulary."""
    other = FAMILIES[(KEYS.index(key) + 1) % len(FAMILIES)]
    return other.model(seed=1, layers=2, window=WINDOW)


@functools.lru_cache(maxsize=None)
def prompt_and_reference(key):
    prompt = torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    return prompt, greedy_reference(target(key), prompt, NEW)


def policy(name):
    return make_policy(name, None if name == "full" else BUDGET, period=8 if name == "rift-dyn" else None,
                       obs_window=8)


@pytest.mark.parametrize("name", ["full", "rift-stat", "rift-dyn"])
@pytest.mark.parametrize("drafter", ["self", "external"])
@pytest.mark.parametrize("key", KEYS)
def test_greedy_equals_target_generate(key, drafter, name):
    prompt, reference = prompt_and_reference(key)
    draft = None if drafter == "self" else external_draft(key)
    pol = policy(name)
    for k in (1, 4, 11):
        dec = SpeculativeDecoder(target(key), draft, pol.layout, draft_length=k)
        res = decode(dec, prompt, NEW, pol.controller)
        assert res.tokens == reference, k
        if drafter == "self" and name == "full":  # the draft computes exactly the target's logits
            assert all(r.accepted == r.draft_length for r in res.rounds), k
        for layer in dec.tcache.layers:  # the target's sliding layers are back at their window after each round
            if getattr(layer, "keys", None) is not None:  # not a linear-attention or cache-free layer
                assert layer.keys.shape[-2] == (WINDOW - 1 if layer.is_sliding else dec.tcache.get_seq_length())
        for layer in dec.dcache.kv_layers:
            if isinstance(layer, SlidingLayer):
                assert layer.n_active == WINDOW - 1
            elif name != "full":
                assert layer.n_active == BUDGET


@pytest.mark.parametrize("key", ["gemma3", "gpt-oss", "qwen3-swa", "mistral-swa"])
def test_draft_cache_with_room_for_everything_equals_the_models_own_cache(key):
    """Rounds of 5 fed tokens, 3 of them rolled back, across the window boundary: the draft cache (a RIFT budget
    that holds every token, the model's windows on sliding layers) gives the logits of the model's own cache fed
    only the kept tokens (to 1e-4: logits of these init-0.2 models are O(1), and a 5-token forward sums in another
    order than a 2-token one; a key outside its window moves them by O(0.1))."""
    model = target(key)
    check_observable(model)
    g = torch.Generator().manual_seed(1)
    rift = RiftCache.for_config(model.config, CacheLayout("rift", budget=64, window=48))
    dense = DynamicCache(config=model.config)
    prompt = torch.randint(0, 128, (12,), generator=g).tolist()  # shorter than the window: it fills while decoding
    torch.testing.assert_close(feed(model, rift, prompt), feed(model, dense, prompt, False), atol=1e-4, rtol=0)
    rift.compress()
    for _ in range(8):
        tokens = torch.randint(0, 128, (5,), generator=g).tolist()
        out = feed(model, rift, tokens)
        rift.rollback(3)
        torch.testing.assert_close(out[:2], feed(model, dense, tokens[:2], False), atol=1e-4, rtol=0)
    assert rift.length == dense.get_seq_length() == 12 + 16
    kinds = rift.active_bytes_by_kind()
    assert kinds["sliding"] > 0 and (kinds["full"] > 0) == (key != "mistral-swa")
    sliding = next(layer for layer in rift.layers if layer.is_sliding)
    assert sliding.n_active == WINDOW - 1
    with pytest.raises(RuntimeError, match="cannot roll back"):
        sliding.crop(-3)  # those tokens left the window at the last round's end


@pytest.mark.parametrize("key", ["gemma3", "mistral-swa"])
def test_rollback_with_sliding_layers_meets_every_accepted_count(key):
    """Sliding layers (gemma3: alternating with full attention; mistral-swa: all sliding), window 16 against an
    80-token prompt. A scripted copy of the target (tests/conftest.py) drafts on a rift-dyn cache (budget 24,
    refreshed every 8 tokens; its sliding layers keep the model's window), and the rounds accept every count 0..k,
    k = 4 (asserted). After each round the draft's cache is bit for bit as if the rejected tokens were never fed
    (tests/conftest.py decode_checking_rollback) and the target's equals the model's own cache fed only the kept
    tokens, one chunk per forward (to 1e-5: the decoder's forward fed 1 + k tokens, the recomputation 1 + n)."""
    tgt = target(key)
    prompt, _ = prompt_and_reference(key)
    reference = greedy_reference(tgt, prompt, script_tokens())
    pol = policy("rift-dyn")
    dec = SpeculativeDecoder(tgt, scripted_draft(tgt, prompt, reference, SCRIPT, SCRIPT_K), pol.layout,
                             draft_length=SCRIPT_K)

    def check_target(chunks):
        for ours, theirs in zip(dec.tcache.layers, recompute(tgt, chunks, record_past=True).layers):
            assert ours.is_sliding == theirs.is_sliding and ours.keys.shape == theirs.keys.shape
            torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=0)

    accepted = decode_checking_rollback(dec, prompt, script_tokens(), pol.controller, check_target)
    assert accepted == SCRIPT + [SCRIPT_K] * 2 and set(accepted) == set(range(SCRIPT_K + 1))
    assert dec.result.tokens == reference and dec.result.refreshes > 0
    assert any(layer.is_sliding and layer.keys.shape[-2] == WINDOW - 1 for layer in dec.tcache.layers)


@pytest.mark.parametrize("key", ["gemma3", "gpt-oss"])
def test_draft_kv_is_flat_in_input_length(key):
    """Budget 64, window 16: the full-attention (RIFT) and sliding parts of the draft's peak KV are the same for
    256- and 512-token prompts."""
    model = target(key)
    pol = make_policy("rift-dyn", 64, period=8, obs_window=8)
    dec = SpeculativeDecoder(model, None, pol.layout, draft_length=4)
    g = torch.Generator().manual_seed(2)
    peaks = []
    for n in (256, 512):
        summary = evaluate(dec, [torch.randint(0, 128, (n,), generator=g).tolist()], pol.controller, 16).summary
        peaks.append((summary["draft_active_kv_bytes_full"], summary["draft_active_kv_bytes_sliding"]))
        assert summary["draft_active_kv_bytes"] == sum(peaks[-1])
    assert peaks[0] == peaks[1] and min(peaks[0]) > 0, peaks
    cfg = model.config
    per_token_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # keys and values, float32
    # At its peak a round holds 1 or 2 pending tokens + k - 1 fed drafts beyond the budget / window.
    assert peaks[0][0] <= 2 * per_token_layer * (64 + 4 + 1)
    assert peaks[0][1] <= 2 * per_token_layer * (WINDOW - 1 + 4 + 1)


# --- sampling: the exact distribution (machinery of tests/test_sampling.py) -----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("key", ["gemma3", "gpt-oss"])
def test_sampling_distribution_matches_target(key):
    """Window 8 against a 24-token prompt (sliding layers really slide), rift-dyn budget 12 with a refresh before
    every round, a draft of the same family with other weights: chi-square at alpha 1e-3 over all 4-token
    sequences."""
    size = dict(vocab=VOCAB, hidden=32, heads=2, kv_heads=1, layers=2, window=8, init=0.3)
    tgt, drf = family(key).model(seed=0, **size), family(key).model(seed=7, **size)
    dec, _ = check_rift_dyn_sampling(tgt, drf)
    assert dec.dcache.active_tokens() == 12, "the full-attention layer is compressed"
    assert dec.dcache.layers[0].is_sliding and dec.dcache.layers[0].n_active == 7, "the sliding layer slides"


# --- attention and refusals -----------------------------------------------------------------------------------------

def test_observer_wraps_the_models_own_attention():
    """GPT-OSS has no SDPA (attention sinks) and gets the eager observer, which computes exactly its eager
    attention; SDPA models get the SDPA observer."""
    oss = family("gpt-oss").model(seed=0, window=WINDOW)
    assert oss.config._attn_implementation == "eager" and observer_for(oss) == "rift_eager"
    assert observer_for(family("gemma3").model(seed=0)) == "rift_sdpa"
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = oss(ids).logits
        check_observable(oss)
        assert oss.config._attn_implementation == "rift_eager"
        torch.testing.assert_close(oss(ids).logits, before, atol=0, rtol=0)
        with pytest.raises(UnsupportedModelError, match="attention sinks"):
            oss(ids, rift_masks=[torch.ones(1, 2, 40, 40, dtype=torch.bool)] * 4)


def test_unsupported_layer_kinds_are_refused_in_one_line(tmp_path):
    """Falcon-H1 runs attention and Mamba side by side in one layer (transformers' ``hybrid`` cache layer), which
    rift-ada does not split; a model whose every layer is linear attention has no KV cache to compress."""
    from transformers import AutoModelForCausalLM, FalconH1Config

    from rift_ada.models import load_pair

    cfg = FalconH1Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                         mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for make in (lambda: SpeculativeDecoder(model), lambda: SpeculativeDecoder(target("llama"), model)):
        with pytest.raises(UnsupportedModelError, match="falcon_h1: cache layers of type hybrid are not") as e:
            make()
        assert "\n" not in str(e.value)
    cfg.save_pretrained(tmp_path)  # the config alone: refused before a tokenizer or weights are read
    with pytest.raises(UnsupportedModelError, match="falcon_h1: cache layers of type hybrid"):
        load_pair(str(tmp_path), "self")
    linear_only = family("qwen3_5").config(layers=2)
    linear_only.layer_types = ["linear_attention"] * 2
    with pytest.raises(UnsupportedModelError, match="qwen3_5_text: no attention layer"):
        RiftCache.for_config(linear_only, CacheLayout("full"))


def test_attention_without_layer_idx_is_refused_in_one_line():
    model = family("llama").model(seed=0, layers=2)
    del model.model.layers[1].self_attn.layer_idx
    with pytest.raises(UnsupportedModelError, match="LlamaAttention has no integer layer_idx") as e:
        SpeculativeDecoder(model)
    assert "\n" not in str(e.value)


def test_compressibility_masks_refuse_sliding_layers():
    model = family("gemma3").model(seed=0, layers=2, window=WINDOW)
    check_observable(model)
    with pytest.raises(UnsupportedModelError, match="full-attention layers only; layer 0"):
        model(torch.zeros(1, 8, dtype=torch.long), rift_masks=[torch.ones(1, 2, 8, 8, dtype=torch.bool)] * 2)


def test_documented_table_is_generated_from_the_family_list():
    table = runpy.run_path(str(ROOT / "experiments" / "architectures_table.py"))["table"]()
    assert table in (ROOT / "docs" / "design.md").read_text(), \
        "paste `python experiments/architectures_table.py` into docs/design.md"
