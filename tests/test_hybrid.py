"""Hybrid models: Qwen3.5 (Gated DeltaNet linear attention, full attention every 4th layer) and Nemotron-H (Mamba-2,
attention, MLP / MoE blocks), as tiny random-init models from transformers' own config classes.

Their linear-attention layers keep a fixed-size conv + recurrent state that the draft cache keeps whole; the RIFT
budget compresses the attention layers only. A recurrent state cannot be cropped: the draft restores a checkpoint
taken after each drafted token, a hybrid target restores its pre-verify states and replays the kept tokens
(``rift_ada.recurrent``). Checked here: greedy output equal to the target's own ``generate`` for every policy, scorer
and k, for self-speculation and for hybrid / attention-only pairs both ways; the exact sampling distribution; the
cache against dense attention with room for everything; rollback against recomputing from scratch; ``evaluate`` on
a saved folder; RefreshEnv's checkers; compressibility masks and LoRA on both layer kinds.
"""

import collections
import copy
import functools
import json
import os
import shutil
import subprocess
import sys
import warnings
from statistics import mean

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from rift_ada import lora, signals
from rift_ada.architectures import family
from rift_ada.attention import use_rift_attention
from rift_ada.cache import RiftCache, RiftLayer
from rift_ada.evaluate import decode
from rift_ada.layout import CacheLayout
from rift_ada.models import greedy_reference
from rift_ada.policies import POLICIES, make_policy
from rift_ada.recurrent import StateLayer
from rift_ada.refresh import PeriodicController, ThresholdController
from rift_ada.speculative import SpeculativeDecoder
from rift_ada.testbed.composed import ASSETS as TESTBED_DIR
from tests.conftest import SCRIPT, SCRIPT_K, feed, recompute, script_tokens, scripted_draft
from tests.test_sampling import K, NEW_TOKENS, VOCAB, check_rift_dyn_sampling

HYBRIDS = ["qwen3_5", "nemotron_h"]
PROMPT, NEW, BUDGET = 80, 32, 24


@functools.lru_cache(maxsize=None)
def model(key, layers=4, seed=0):
    return family(key).model(seed=seed, layers=layers)


@functools.lru_cache(maxsize=None)
def prompt_and_reference(key):
    prompt = torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    return prompt, greedy_reference(model(key), prompt, NEW)


def policy(name, scorer="snapkv"):
    controller = ThresholdController([("acc_mean", "<", 0.9)], min_gap=4) if name == "rift-ada" else None
    return make_policy(name, None if name == "full" else BUDGET, period=8 if name == "rift-dyn" else None,
                       controller=controller, obs_window=8, scorer=scorer)


# (target, drafter): self-speculation on each hybrid, hybrid targets with an attention-only draft, an attention-only
# target with hybrid drafts (tests/test_architectures.py adds a hybrid pair: Qwen3.5 drafted by Nemotron-H).
PAIRS = [("qwen3_5", "self"), ("nemotron_h", "self"), ("qwen3_5", "llama"), ("nemotron_h", "llama"),
         ("llama", "qwen3_5"), ("llama", "nemotron_h")]


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("pair", PAIRS, ids="<-".join)
def test_greedy_equals_target_generate(pair, name):
    key, drafter = pair
    prompt, reference = prompt_and_reference(key)
    draft = None if drafter == "self" else model(drafter, layers=2, seed=1)
    pol = policy(name)
    for k in (1, 4, 11):
        dec = SpeculativeDecoder(model(key), draft, pol.layout, draft_length=k)
        res = decode(dec, prompt, NEW, pol.controller)
        assert res.tokens == reference, k
        if drafter == "self" and name == "full":  # a full-cache self-draft computes the target's logits
            assert all(r.accepted == r.draft_length for r in res.rounds), k
        if pol.layout.tail_limit is not None:  # window and rift layouts (snapkv appends while decoding)
            assert all(layer.n_active == BUDGET for layer in dec.dcache.rift_layers), "attention is compressed"
        if key != "llama":  # a hybrid target replays exactly the rounds with a rejection
            assert [r.target_replayed for r in res.rounds] == [r.accepted < r.draft_length for r in res.rounds]


@pytest.mark.parametrize("pair", PAIRS, ids="<-".join)
def test_greedy_is_lossless_at_every_round_length(pair):
    """Rounds of any k in 0..k (0: one target step): hybrid targets replay, hybrid drafts restore their states and
    catch up on the tokens they did not draft, and the output stays the target's."""
    from tests.test_speculative import decode_with_round_lengths

    key, drafter = pair
    prompt, reference = prompt_and_reference(key)
    draft = None if drafter == "self" else model(drafter, layers=2, seed=1)
    pol = policy("rift-dyn")
    tokens, lengths = decode_with_round_lengths(SpeculativeDecoder(model(key), draft, pol.layout, draft_length=5),
                                                prompt, NEW, 5)
    assert tokens == reference and 0 in lengths, lengths


@pytest.mark.parametrize("scorer", ["tova", "keynorm", "streaming", "random"])
@pytest.mark.parametrize("key", HYBRIDS)
def test_greedy_every_scorer(key, scorer):
    prompt, reference = prompt_and_reference(key)
    pol = policy("rift-dyn", scorer)
    for k in (1, 4, 11):
        dec = SpeculativeDecoder(model(key), None, pol.layout, draft_length=k)
        assert decode(dec, prompt, NEW, pol.controller).tokens == reference, k


# --- the caches ------------------------------------------------------------------------------------------------------

def state_tensors(layer):
    """A linear-attention layer's conv state (its working size: the last conv_kernel columns) and recurrent state."""
    k = layer.conv_kernel_size[0]
    return [layer.conv_states[0][..., -k:], layer.recurrent_states[0]]


def assert_states_close(ours, theirs, atol):
    for a, b in zip(ours.layers, theirs.layers):
        if isinstance(a, LinearAttentionLayer):
            for x, y in zip(state_tensors(a), state_tensors(b)):
                torch.testing.assert_close(x, y, atol=atol, rtol=0)


@pytest.mark.parametrize("key", HYBRIDS)
def test_cache_with_room_for_everything_equals_dense_and_rolls_back(key):
    """Budget 128 against 60 + 8 x 4 tokens, every token fed alone with a checkpoint after all but the round's last
    (as the decoder drafts), 0-3 of them rolled back: the logits, states and keys equal the model's own cache fed
    only the kept tokens, one at a time (to 1e-5: the RIFT cache orders its keys [importance | tail])."""
    m = model(key)
    use_rift_attention(m)
    g = torch.Generator().manual_seed(1)
    rift = RiftCache.for_config(m.config, CacheLayout("rift", budget=128, window=100, obs_window=8))
    dense = DynamicCache(config=m.config)
    prompt = torch.randint(0, 128, (60,), generator=g).tolist()
    torch.testing.assert_close(feed(m, rift, prompt), feed(m, dense, prompt, False), atol=1e-5, rtol=0)
    rift.compress()
    for rnd in range(8):
        tokens = torch.randint(0, 128, (4,), generator=g).tolist()
        out = []
        for i, t in enumerate(tokens):
            out.append(feed(m, rift, [t])[-1])
            if i < 3:
                rift.checkpoint()
        rejected = rnd % 4
        rift.rollback(rejected)
        kept = tokens[:4 - rejected]
        ref = torch.stack([feed(m, dense, [t], False)[-1] for t in kept])
        torch.testing.assert_close(torch.stack(out[:len(kept)]), ref, atol=1e-5, rtol=0)
        assert_states_close(rift, dense, 1e-5)
    assert rift.length == dense.get_seq_length() == 60 + 8 * 4 - sum(r % 4 for r in range(8))
    for ours, theirs in zip(rift.layers, dense.layers):
        if isinstance(ours, RiftLayer):  # every token is held: sorted by position, the keys are the dense ones
            order = ours.active_positions()[0, 0].argsort()
            torch.testing.assert_close(ours.keys[:, :, order], theirs.keys, atol=1e-5, rtol=0)
    kinds = rift.active_bytes_by_kind()
    assert kinds["state"] == sum(t.nbytes for layer in rift.state_layers for t in state_tensors(layer)) > 0
    assert kinds["full"] > 0 and kinds["sliding"] == 0 and rift.active_bytes() == kinds["full"]
    with pytest.raises(RuntimeError, match="cannot roll a linear-attention layer back") as e:
        rift.crop(-1)  # no checkpoint was taken since the last round ended
    assert "\n" not in str(e.value)


def perturbed(m, std=0.05):
    """A draft that agrees with ``m`` often but not always: ``m`` with a perturbed output head."""
    d = copy.deepcopy(m)
    with torch.no_grad():
        w = d.get_output_embeddings().weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * std)
    return d


def assert_same(ours, theirs, atol=0.0, rtol=0.0):
    """States and attention keys / values equal (bit for bit by default)."""
    assert ours.get_seq_length() == theirs.get_seq_length()
    for a, b in zip(ours.layers, theirs.layers):
        if isinstance(a, LinearAttentionLayer):
            pairs = zip(state_tensors(a), state_tensors(b))
        elif getattr(b, "keys", None) is not None:  # attention (a full draft cache keeps its keys in order)
            pairs = [(a.keys, b.keys), (a.values, b.values)]
        else:
            continue
        for x, y in pairs:
            torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


@pytest.mark.parametrize("key", HYBRIDS)
def test_rollback_equals_recomputing_from_scratch(key):
    """A hybrid target with a hybrid full-cache draft, scripted (tests/conftest.py) so that its rounds accept every
    count 0..k, k = 4 (asserted): a rejection at the first draft, at the last (the target still has to replay) and
    in between, and all accepted. After each round both caches, states and attention KV, are bit for bit the
    model's own cache fed only the kept tokens in the same forwards (the target: the prompt, then each round's
    1 + n kept tokens in one forward; the draft: one token a forward), and within float rounding of one forward over
    all of them (the chunked and the step-wise delta-rule / scan kernels sum in other orders: up to ~2e-4 on these
    O(1) states and keys, where one wrong token two positions back moves them by 0.04 to 4)."""
    tgt = model(key)
    prompt, _ = prompt_and_reference(key)
    reference = greedy_reference(tgt, prompt, script_tokens())
    dec = SpeculativeDecoder(tgt, scripted_draft(tgt, prompt, reference, SCRIPT, SCRIPT_K), CacheLayout("full"),
                             draft_length=SCRIPT_K)
    dec.reset(prompt, script_tokens())
    t_chunks, d_chunks = [prompt], [prompt]
    while not dec.done:
        t_pending, d_pending, generated = list(dec.target_pending), list(dec.draft_pending), len(dec.result.tokens)
        rec = dec.step()
        new = dec.result.tokens[generated:]
        t_chunks.append(t_pending + new[:rec.accepted])
        d_chunks += [d_pending] + [[t] for t in new[:min(rec.accepted, rec.draft_length - 1)]]
        seen = prompt + dec.result.tokens
        assert_same(dec.tcache, recompute(tgt, t_chunks, record_past=True))
        assert_same(dec.dcache, recompute(dec.draft, d_chunks))
    assert_same(dec.tcache, recompute(tgt, [seen[:-1]]), atol=1e-3)
    assert_same(dec.dcache, recompute(dec.draft, [seen[:dec.dcache.length]]), atol=1e-3)
    accepted = [r.accepted for r in dec.result.rounds]
    assert accepted == SCRIPT + [SCRIPT_K] * 2 and set(accepted) == set(range(SCRIPT_K + 1))
    assert [r.target_replayed for r in dec.result.rounds] == [a < SCRIPT_K for a in accepted]
    assert dec.result.tokens == reference


@pytest.mark.parametrize("key", HYBRIDS)
def test_compressed_draft_rollback_leaves_it_as_if_never_fed(key):
    """Self-speculation on a rift-dyn draft cache (budget 24): after each round the draft cache is bit for bit the
    cache it was before the round fed only the kept tokens (keys, backing store, queries and states)."""
    tgt = model(key)
    pol = policy("rift-dyn")
    dec = SpeculativeDecoder(tgt, None, pol.layout, draft_length=4)
    prompt, _ = prompt_and_reference(key)
    dec.reset(prompt, 40)
    partial = 0
    while not dec.done:
        before, pending, generated = dec.dcache.clone(), list(dec.draft_pending), len(dec.result.tokens)
        rec = dec.step(pol.controller.decide(signals.observe(dec.state)))
        new = dec.result.tokens[generated:]
        kept = new[:rec.accepted] if rec.accepted < rec.draft_length else new[:rec.draft_length - 1]
        partial += 0 < rec.accepted < rec.draft_length
        if rec.refreshed:
            before.refresh()
        for tokens in [pending] + [[t] for t in kept] if rec.draft_length else []:
            feed(tgt, before, tokens)
        before.rollback(0)
        for a, b in zip(dec.dcache.layers, before.layers):
            if isinstance(a, StateLayer):
                assert all(torch.equal(x, y) for x, y in zip(state_tensors(a), state_tensors(b)))
            elif isinstance(a, RiftLayer):
                for name in ("keys", "values", "store_k", "imp_pos", "queries", "query_pos"):
                    assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert partial > 0


# --- sampling: the exact distribution (machinery of tests/test_sampling.py) -----------------------------------------

SAMPLING_PAIRS = [("qwen3_5", "nemotron_h"), ("nemotron_h", "qwen3_5")]  # each model on each side


@pytest.mark.slow
@pytest.mark.parametrize("pair", SAMPLING_PAIRS, ids="<-".join)
def test_sampling_distribution_matches_target(pair):
    """Vocabulary 6, a 24-token prompt, rift-dyn budget 12 refreshed before every round, k = 2, hybrid target and
    hybrid draft (draft restores and target replays both happen): chi-square at alpha 1e-3 over all 4-token
    sequences."""
    size = dict(vocab=VOCAB, hidden=32, heads=2, kv_heads=1, layers=2, init=0.3)
    tgt, drf = family(pair[0]).model(seed=0, **size), family(pair[1]).model(seed=7, **size)
    dec, prompt = check_rift_dyn_sampling(tgt, drf)
    assert dec.dcache.active_tokens() == 12, "the attention layer is compressed"
    # The setting reaches every branch of the rule: each accepted count in a first round.
    firsts = collections.Counter()
    for seed in range(100):
        dec.seed = seed
        firsts[decode(dec, prompt, NEW_TOKENS, PeriodicController(1)).rounds[0].accepted] += 1
    assert all(firsts[a] >= 5 for a in range(K + 1)), firsts


# --- evaluate, the environment, compressibility training ----------------------------------------------------------

def saved_hybrid(folder, key="qwen3_5", seed=0):
    """A tiny hybrid with the testbed's tokenizer (1,024 tokens), saved as an ordinary HuggingFace folder."""
    family(key).model(seed=seed, vocab=1024).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TESTBED_DIR / "lm-target" / name, folder / name)
    return folder


def test_evaluate_on_a_saved_hybrid(tmp_path, monkeypatch):
    """A saved Qwen3.5 drafted by another (other weights, so drafts are rejected): the draft's attention KV flat in
    input length at a fixed budget; its state bytes the model's fixed state size; the target's replay share the
    share of rounds that rejected a draft, and the rollback time the rounds' mean."""
    import rift_ada.evaluate as E
    from rift_ada.evaluate import build_parser, run

    evaluations, own = [], E.evaluate
    monkeypatch.setattr(E, "evaluate", lambda *a, **kw: evaluations.append(own(*a, **kw)) or evaluations[-1])
    folder = str(saved_hybrid(tmp_path / "qwen3_5"))
    drafter = str(saved_hybrid(tmp_path / "qwen3_5-draft", seed=1))
    common = ["--target", folder, "--drafter", drafter, "--policy", "rift-dyn", "--period", "8", "--budget", "64",
              "--prompts", "1", "--max-new-tokens", "16", "--draft-length", "4"]
    outs = [run(build_parser().parse_args([*common, "--input-tokens", str(n)])) for n in (512, 1024)]
    cfg = family("qwen3_5").config(vocab=1024)
    linear = cfg.layer_types.count("linear_attention")
    conv_dim = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    per_layer = 4 * (conv_dim * cfg.linear_conv_kernel_dim
                     + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
    kv_per_token = cfg.layer_types.count("full_attention") * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    for out, ev in zip(outs, evaluations, strict=True):
        rounds = [x for res in ev.results for x in res.rounds]
        assert out["target_replay_share"] == mean(x.accepted < x.draft_length for x in rounds) > 0
        assert out["rollback_ms_per_round"] == 1000 * mean(x.rollback_seconds for x in rounds) > 0
        assert out["target_greedy_match"] == 1.0
        assert out["draft_state_bytes"] == linear * per_layer
        assert out["draft_state_checkpoint_bytes"] == 3 * linear * per_layer  # k - 1 copies
        assert 64 * kv_per_token < out["draft_active_kv_bytes"] <= (64 + 4 + 1) * kv_per_token
    assert outs[0]["draft_active_kv_bytes"] == outs[1]["draft_active_kv_bytes"]
    cli = subprocess.run([sys.executable, "-m", "rift_ada.evaluate", *common, "--input-tokens", "512", "--json"],
                         env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["draft_state_bytes"] == linear * per_layer


def test_refresh_env_checkers_pass_with_a_hybrid_pair():
    import gymnasium as gym
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    import rift_ada.envs as envs

    dec = SpeculativeDecoder(model("qwen3_5"), model("nemotron_h", layers=2, seed=1),
                             CacheLayout("rift", BUDGET, obs_window=8), draft_length=4)
    prompts = [torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    env = gym.make(envs.ENV_ID, decoder=dec, prompts=prompts, max_new_tokens=20).unwrapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check(env)
        sb3_check(env)


@pytest.mark.parametrize("key", HYBRIDS)
def test_compressibility_masks_and_lora_on_hybrids(key):
    """The trainer's masked full-sequence pass gives the compressed cache's logits (the masks apply to the
    attention layers; linear-attention layers run unmasked, as their states are exact), and LoRA adapts both layer
    kinds: attention and MLP projections and the linear-attention block's own."""
    from rift_ada.trainers import compressibility as C

    m = family(key).model(seed=0, init=0.05)
    use_rift_attention(m)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (120,), generator=g).tolist()
    cont = torch.randint(0, 128, (40,), generator=g).tolist()
    layout = make_policy("rift-dyn", 40, period=10, window=12, obs_window=8).layout
    cache = RiftCache.for_config(m.config, layout)
    feed(m, cache, prompt)
    cache.compress()
    sels = [[(len(prompt), layer.imp_pos.clone())] if isinstance(layer, RiftLayer) else None for layer in cache.layers]
    logits = []
    for i, tok in enumerate(cont):
        if i and i % 10 == 0:
            cache.refresh()
            for s, layer in zip(sels, cache.layers):
                if s is not None:
                    s.append((len(prompt) + i, layer.imp_pos.clone()))
        logits.append(feed(m, cache, [tok])[-1])
        cache.rollback(0)
    ids = torch.tensor([prompt + cont])
    masks = C.build_masks(ids.shape[1], len(prompt), sels, window=12)
    with torch.no_grad():
        masked = m(ids, position_ids=torch.arange(ids.shape[1])[None], rift_masks=masks).logits[0, len(prompt):]
    torch.testing.assert_close(masked, torch.stack(logits), atol=1e-5, rtol=0)
    # The trainer's dense selection at the prompt end is the inference prefill's.
    dense = C.selections(C.dense_capture(m, ids), len(prompt), ids.shape[1], layout, period=10)
    assert all((s is None) == (d is None) for s, d in zip(sels, dense))
    assert all(torch.equal(s[0][1], d[0][1]) for s, d in zip(sels, dense) if s is not None)

    peft_model = lora.attach(copy.deepcopy(m))
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in peft_model.named_parameters()
               if "lora_A" in name}
    own = {"qwen3_5": {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}, "nemotron_h": {"in_proj"}}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"} | own[key] <= adapted, adapted
    sample = {"prompt_ids": torch.tensor(prompt), "continuation_ids": torch.tensor(cont),
              "topk_ids": torch.randint(0, 128, (40, 8), generator=g), "topk_logprobs": torch.full((40, 8), -3.0)}
    peft_model.train()
    loss, _ = C.sample_loss(peft_model, sample, layout, period=10)
    loss.backward()
    grads = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, p in peft_model.named_parameters()
             if p.grad is not None}
    assert own[key] <= grads, grads
