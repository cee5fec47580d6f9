"""The static-shape draft step (``rift_ada.static``): it computes what the draft's own forward computes and leaves the
cache as that forward does; compiled, one graph serves every context length and refresh; every step has the same
shapes and the same buffer addresses (what a CUDA graph replays); sampling through it keeps the target's
distribution; drafts it cannot run are refused in one line."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

from rift_ada.architectures import UnsupportedModelError, family
from rift_ada.data import build_tasks, encode
from rift_ada.evaluate import decode
from rift_ada.layout import CacheLayout
from rift_ada.models import greedy_reference
from rift_ada.policies import make_policy
from rift_ada.refresh import PeriodicController
from rift_ada.speculative import Decoding, SpeculativeDecoder, forward
from tests.conftest import cached_testbed_pair, random_model
from tests.test_sampling import check_rift_dyn_sampling

PROMPT, BUDGET = 80, 24


@functools.lru_cache(maxsize=None)
def model(key):
    return family(key).model(seed=0, window=16)


def prompt(n: int = PROMPT, seed: int = 0) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def layout():
    return make_policy("rift-dyn", BUDGET, period=8, obs_window=8).layout


@pytest.mark.parametrize("key,attention", [("llama", "sdpa"), ("qwen3", "sdpa"), ("mistral", "sdpa"),
                                           ("qwen3", "matmul")])
def test_static_step_computes_the_drafts_own_forward(key, attention, monkeypatch):
    """Token by token over 40 steps, with a rollback and a refresh every 5: the static step's logits equal the
    model's forward over the same RIFT cache to 1e-5, and both caches hold the same entries, positions and
    observation queries (Qwen3: its per-head q/k norms; Mistral and Llama: grouped-query attention; ``matmul``: the
    attention the steps run on CUDA)."""
    monkeypatch.setattr("rift_ada.static.ATTENTION", attention)
    m = model(key)
    ours, theirs = (SpeculativeDecoder(m, None, layout(), draft_length=4, draft_step=s) for s in ("static", "model"))
    ids = prompt()
    for dec in (ours, theirs):
        dec.reset(ids, 64)
    token = ids[-1]
    for i in range(40):
        a = ours._static(ours.dcache, token, ours.dcache.length)
        with torch.inference_mode():
            b = forward(theirs.draft, theirs.dcache, [token], theirs.device, observe=True)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        token = int(b.argmax())
        if i % 5 == 4:
            with torch.inference_mode():
                for dec in (ours, theirs):
                    dec.dcache.rollback(1)
                    dec.dcache.refresh()
        for x, y in zip(ours.dcache.rift_layers, theirs.dcache.rift_layers):
            assert x.length == y.length and x.n_active == y.n_active and torch.equal(x.imp_pos, y.imp_pos)
            for name in ("keys", "values", "queries", "store_k", "store_v"):
                torch.testing.assert_close(getattr(x, name), getattr(y, name), atol=1e-5, rtol=1e-5)
            assert torch.equal(x.query_pos, y.query_pos)


@pytest.mark.parametrize("key", ["llama", "qwen3", "mistral"])
def test_static_verify_computes_the_targets_own_forward(key):
    """Blocks of 5 and of 3 (padded to 5) tokens on the static cache, each followed by a crop of 2: logits equal the
    target's forward on its own cache to 1e-5, and the cache's visible keys and values equal that cache's."""
    m = model(key)
    ours, theirs = (SpeculativeDecoder(m, None, layout(), draft_length=4, verify_step=s) for s in ("static", "model"))
    ids = prompt()
    for dec in (ours, theirs):
        dec.reset(ids, 64)
    g = torch.Generator().manual_seed(1)
    for n in (5, 3, 5, 5, 3):
        tokens = torch.randint(1, 128, (n,), generator=g).tolist()
        a = ours._static_verify(ours.tcache, tokens)
        with torch.inference_mode():
            b = forward(theirs.target, theirs.tcache, tokens, theirs.device, all_logits=True)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for dec in (ours, theirs):
            dec.tcache.crop(-2)
        length = theirs.tcache.get_seq_length()
        assert ours.tcache.length == length
        for i, layer in enumerate(theirs.tcache.layers):
            torch.testing.assert_close(ours.tcache.keys[i][:, :, :length], layer.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours.tcache.values[i][:, :, :length], layer.values, atol=1e-5, rtol=1e-5)


def test_every_step_reads_and_writes_the_same_static_buffers():
    """What CUDA-graph replay needs, checked on CPU: over two prompts of different lengths, with refreshes and
    rejections, every draft step is called with the very same tensors (shapes, dtypes and addresses: one set of
    buffers at every length and every refresh), every verify with the same ones within a prompt, and each of them is
    a static graph input (``mark_static_address``): the only kind a graph may write in place and still be replayed."""
    m = random_model("llama", vocab=128, layers=2, hidden=64, heads=4, kv_heads=2, init=0.2)
    draft = random_model("llama", vocab=128, layers=2, hidden=64, heads=4, kv_heads=2, seed=3, init=0.2)
    dec = SpeculativeDecoder(m, draft, layout(), draft_length=4, draft_step="static", verify_step="static")
    calls = {"draft": [], "verify": []}

    def recording(step, fn):
        def record(*args):
            calls[step][-1].add(tuple((tuple(t.shape), t.dtype, t.data_ptr()) for t in args))
            assert all(getattr(t, "_dynamo_static_input_type", None) for t in args), "an input is not static"
            return fn(*args)
        return record

    dec._static.fn = recording("draft", dec._static.fn)
    dec._static_verify.fn = recording("verify", dec._static_verify.fn)
    # Padded to its block as when compiled (eager, a shorter round verifies just its tokens: cheaper, and the
    # joint controller's k = 0 rounds are plain steps).
    dec._static_verify.pad = True
    refreshes, rejected = 0, 0
    for n in (PROMPT, 2 * PROMPT):
        for step in calls:
            calls[step].append(set())
        out = decode(dec, prompt(n, seed=n), 60, PeriodicController(3))
        refreshes += out.refreshes
        rejected += sum(r.accepted < r.draft_length for r in out.rounds)
        assert out.tokens == greedy_reference(m, prompt(n, seed=n), 60)
    assert refreshes >= 8 and rejected >= 3, "the runs refresh and reject"
    # The draft step: one set of buffers at both lengths. The verify: one per prompt (its cache holds the prompt).
    assert len(calls["draft"][0] | calls["draft"][1]) == 1, calls["draft"]
    assert [len(c) for c in calls["verify"]] == [1, 1] and calls["verify"][0] != calls["verify"][1]


@contextlib.contextmanager
def cudagraph_verdicts():
    """Inductor's own verdict on each graph it compiles meanwhile, as it decides it on CUDA: the message with which it
    would skip CUDA graphs for writing to graph inputs in place ("mutated inputs"), or None. Inductor runs that check
    only for CUDA graphs, so on CPU it is run here on the same data (the graph's mutated and static inputs), with
    inductor's graph cache off (a cached graph is loaded, not built, and would not be seen)."""
    from torch._inductor import config, output_code
    from torch._inductor.cudagraph_utils import check_for_mutation_ignore_cuda_graph_managed_tensor as check

    verdicts = []
    init = output_code.CompiledFxGraph.__init__

    def recording(self, current_callable, graph, gm, *args, **kwargs):
        init(self, current_callable, graph, gm, *args, **kwargs)
        static = kwargs["static_input_idxs"] if "static_input_idxs" in kwargs else args[6]
        verdicts.append(check(gm, graph.mutated_inputs, graph.mutated_input_idxs, static))

    with config.patch(fx_graph_cache=False), mock.patch.object(output_code.CompiledFxGraph, "__init__", recording):
        yield verdicts


def test_the_cudagraph_verdict_sees_an_input_written_in_place():
    """The check above can fail: a graph that writes into an unmarked input is skipped, a marked one is not."""
    from rift_ada.static import static_buffer

    def write(buf, x):
        buf.index_copy_(0, torch.tensor([1]), x)
        return buf.sum()

    torch._dynamo.reset()
    with cudagraph_verdicts() as verdicts:
        for buf in (torch.zeros(3), static_buffer((3,), torch.float32, "cpu")):
            torch._dynamo.reset()  # a graph of its own for each
            torch.compile(write, fullgraph=True)(buf, torch.ones(1))
    assert len(verdicts) == 2 and "mutated inputs" in verdicts[0] and verdicts[1] is None


@pytest.mark.slow
def test_compiled_rift_dyn_is_lossless_with_one_graph_at_every_length():
    """The shipped pair, rift-dyn (budget 256, a refresh once 8 tokens passed), the draft step and the verify
    compiled: greedy output equals the target's own greedy ``generate`` at two prompt lengths, dynamo compiles one
    graph for the draft step and one for the verify at both (fullgraph: a graph break would raise), each round
    reads the device once, and inductor would replay every graph as a CUDA graph (no input written in place that is
    not a static input: the H200's "skipping cudagraphs due to mutated inputs")."""
    pair = cached_testbed_pair("testbed")
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    dec = SpeculativeDecoder.for_pair(pair, CacheLayout("rift", 256),
                                      Decoding(11, draft_step="compiled", verify_step="compiled"))
    eos = pair.tokenizer.eos_token_id
    with cudagraph_verdicts() as verdicts:
        for n in (600, 1100):
            ids = encode(pair.tokenizer, build_tasks(pair.tokenizer, "low", n=1, input_tokens=n, seed=1)[0].prompt)
            reads = dec.host_reads
            out = decode(dec, ids, 64, PeriodicController(8))
            assert out.refreshes >= 3 and dec.host_reads - reads == len(out.rounds)
            assert out.tokens == greedy_reference(pair.target, ids, 64, eos)
    # The draft step's one graph and the verify's one: its cache's slot axis (the prompt's length) is a size the graph
    # takes.
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert verdicts == [None] * 2, verdicts


@pytest.mark.slow
def test_compiled_step_samples_the_targets_distribution():
    """The sampling check of tests/test_sampling.py (chi-square at alpha 1e-3 over 2,000 sampled 4-token
    sequences, rift-dyn refreshed before every round) with the draft step and the verify compiled."""
    from tests.test_sampling import models

    target, draft, _ = models()
    check_rift_dyn_sampling(target, draft, step="compiled")


def test_what_the_static_step_cannot_run_is_refused_in_one_line():
    cases = [(dict(draft_step="compiled"), "gemma3", "static .compiled. draft step runs llama"),
             (dict(verify_step="static"), "gemma3", "static .compiled. target step runs llama"),
             (dict(draft_step="static"), "mistral-swa", "draft step needs every layer to be full attention"),
             (dict(verify_step="compiled"), "qwen3-swa", "target step needs every layer to be full attention")]
    for kw, key, phrase in cases:
        with pytest.raises(UnsupportedModelError, match=phrase) as e:
            SpeculativeDecoder(model(key), None, layout(), **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="verify_step must be"):
        SpeculativeDecoder(model("llama"), None, layout(), verify_step="fast")


@pytest.mark.parametrize("tokens", [1, 3])
def test_grouped_attention_equals_sdpa_gqa(tokens):
    """The query heads folded into their KV head's rows give SDPA's own grouped-query attention, head for head, under
    a causal mask over a buffer longer than the context (the static verify's case) and without grouping; so do the
    two matmuls and softmax of ``decode_attention`` (the steps' attention on CUDA)."""
    from rift_ada.static import decode_attention, grouped_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, tokens, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 40, 16, generator=g)
    pos = torch.arange(30, 30 + tokens)
    mask = (torch.arange(40)[None] <= pos[:, None])[None, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    k6, v6 = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    for attend in (grouped_attention, decode_attention):
        torch.testing.assert_close(attend(q, k, v, mask, 0.3), want)
        torch.testing.assert_close(attend(q, k6, v6, mask, 0.3), want)
