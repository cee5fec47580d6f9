import copy
import functools
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# torch.compile's C++ backend imports setuptools, whose distutils shim asserts (and fails the compile) when the
# standard library's distutils was imported earlier in the same process: in a long-lived xdist worker that depends on
# which test files ran there before (seen once in 3 suite runs). The standard library's distutils serves inductor.
os.environ.setdefault("SETUPTOOLS_USE_DISTUTILS", "stdlib")
torch.set_num_threads(1)  # tiny models: threads only add overhead
# The scripts the tests run as subprocesses inherit one thread too: beside the other xdist worker, a subprocess with
# torch's default (one thread per core) oversubscribes the cores, and OpenMP's spinning threads then slow both (the
# paper-regime test: 423 s at two threads beside a worker and a bench, 125 s at one beside a worker).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Modules holding a slow test run first. Under ``--dist loadfile`` a module runs whole on one worker, and a long
    module dispatched last leaves the other worker idle until it ends (longest first: the classic fix)."""
    slow = {item.path for item in items if item.get_closest_marker("slow") or item.get_closest_marker("timeout")}
    items.sort(key=lambda item: item.path not in slow)  # stable: each module's own order is kept


# Tests that need *a* real trained pair use the trained testbed models alone (``testbed-lm``): the shipped pair
# composes a hand-set copier beside them and costs about ten times the compute. Tests of the shipped pair's own
# figures (tests/test_regression.py, tests/test_composed.py) load ``testbed``.
LM_TARGET, LM_DRAFT = "testbed-lm", "testbed-lm-draft"


@pytest.fixture(scope="session")
def tokenizer():
    from rift_ada.models import load_tokenizer

    return load_tokenizer(LM_TARGET)


@pytest.fixture(scope="session")
def testbed_target():
    from rift_ada.models import load_model

    return load_model(LM_TARGET)


@pytest.fixture(scope="session")
def testbed_draft():
    from rift_ada.models import load_model

    return load_model(LM_DRAFT)


def random_model(arch: str = "llama", vocab: int = 128, layers: int = 2, hidden: int = 64, heads: int = 4,
                 kv_heads: int = 2, seed: int = 0, init: float = 0.2):
    """A random-init causal LM with grouped-query attention. A large init makes logits peaked, so greedy decoding
    has no near-ties that batched and step-wise matmuls could order differently."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from rift_ada.attention import use_rift_attention  # noqa: F401  (registers the attention)

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                  max_position_embeddings=4096, initializer_range=init, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def feed(model, cache, tokens, observe=True):
    """One forward of ``tokens`` over ``cache`` at their logical positions (recording queries for a RiftCache)."""
    start = cache.get_seq_length()
    ids = torch.tensor([tokens])
    pos = torch.arange(start, start + len(tokens))[None]
    kw = {"rift_observer": cache} if observe else {}
    with torch.no_grad():
        return model(ids, cache=cache, position_ids=pos, **kw).logits[0]


def policy_of(name: str, budget: int | None = None, period: int = 8, **kw):
    """A named policy (``rift_ada.policies``); ``period`` applies to rift-dyn only, so tests can loop over names."""
    from rift_ada.policies import make_policy

    return make_policy(name, None if name == "full" else budget, period=period if name == "rift-dyn" else None,
                       controller="never" if name == "rift-ada" else None, **kw)


def layout_of(name: str, budget: int | None = None, **kw):
    """The cache layout of a named policy (tests that drive the cache themselves decide refreshes)."""
    return policy_of(name, budget, **kw).layout


@functools.lru_cache(maxsize=None)
def cached_testbed_pair(drafter: str):
    from rift_ada.models import load_pair

    return load_pair(LM_TARGET, "testbed-lm" if drafter == "testbed" else drafter)


@functools.lru_cache(maxsize=None)
def train_prompts(prompts: int, input_tokens: int) -> tuple:
    from rift_ada.data import build_tasks, encode_prompts

    tok = cached_testbed_pair("self").tokenizer
    tasks = build_tasks(tok, "low", n=prompts, input_tokens=input_tokens, seed=0, split="train")
    return tuple(tuple(p) for p in encode_prompts(tok, tasks))


def env_kw(budget: int = 128, input_tokens: int = 1024, prompts: int = 2, max_new_tokens: int = 40,
           drafter: str = "self") -> dict:
    """What a RefreshEnv is handed: a fresh decoder (self-speculation on the testbed, a RIFT layout; the models are
    shared) and encoded training-split `low` prompts. Each env gets its own decoder: they hold decoding state."""
    from rift_ada.layout import CacheLayout
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    pair = cached_testbed_pair(drafter)
    dec = SpeculativeDecoder.for_pair(pair, CacheLayout("rift", budget), Decoding())
    return dict(decoder=dec, prompts=train_prompts(prompts, input_tokens), max_new_tokens=max_new_tokens)


def scripted_draft(model, prompt: list[int], reference: list[int], accepted: list[int], k: int):
    """A copy of ``model`` as a greedy draft whose proposals are scripted so that decoding round i accepts exactly
    ``accepted[i]`` of its k drafts (rounds after the list accept all). It proposes the target's greedy token
    (``reference``: the target's greedy continuation of ``prompt``) except at one position per round that must
    reject, where it proposes another token. The copy runs its forwards as any draft (its cache fills, rolls back,
    refreshes); only its output logits are replaced. With every count 0..k in ``accepted``, a test meets each."""
    assert all(0 <= a <= k for a in accepted)
    wrong, index = set(), 1  # reference[0] comes from the target's prefill; round 1 drafts reference[1:k + 1]
    for a in accepted:
        if a < k:
            wrong.add(index + a)
        index += a + 1
    assert index <= len(reference), "the reference is too short for the schedule"
    draft = copy.deepcopy(model)
    vocab = model.config.vocab_size

    def propose(module, args, kwargs, output):
        pos = kwargs.get("position_ids")
        if pos is None:  # a probe forward (rift_ada.attention.check_observable)
            return output
        i = int(pos[0, -1]) + 1 - len(prompt)  # the index in ``reference`` of the token this forward predicts
        if 0 <= i < len(reference):
            token = (reference[i] + 1) % vocab if i in wrong else reference[i]
            output.logits = torch.nn.functional.one_hot(torch.tensor(token), vocab).float().expand_as(output.logits)
        return output

    draft.register_forward_hook(propose, with_kwargs=True)
    return draft


# k = 4 and the accepted count of each round: every count 0..k, each after several others.
SCRIPT_K, SCRIPT = 4, [4, 0, 1, 2, 3, 4, 3, 2, 1, 0, 4, 0]


def script_tokens(accepted: list[int] = SCRIPT, k: int = SCRIPT_K, extra_rounds: int = 2) -> int:
    """max_new_tokens for a scripted run: the first token, the scripted rounds, then ``extra_rounds`` that accept
    all k (so that every round drafts k)."""
    return 1 + sum(a + 1 for a in accepted) + extra_rounds * (k + 1)


def assert_same_layers(ours, theirs):
    """Every tensor and number each attention layer of two draft caches holds is the same, bit for bit. Of a
    preallocated buffer (``_name``), the filled part: its property ``name``, or the public view beside it
    (``keys`` / ``values`` / ``queries`` / ``query_pos``), which this loop compares in its turn."""
    for i, (a, b) in enumerate(zip(ours.layers, theirs.layers)):
        for name, x in vars(a).items():
            if name.startswith("_") and isinstance(getattr(type(a), name[1:], None), property):
                name, x = name[1:], getattr(a, name[1:])
            elif name.startswith("_") and isinstance(x, torch.Tensor):
                continue
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, getattr(b, name)), (i, name)
            elif isinstance(x, (int, float)):
                assert x == getattr(b, name), (i, name)


def decode_checking_rollback(dec, prompt: list[int], new_tokens: int, controller=None, check_target=None):
    """Decode round by round. After each round: the target's cache holds every token but the last emitted, the
    draft's every token but the pending one (two after a round that accepted all k drafts), and the draft cache is,
    bit for bit, the cache before the round (refreshed if the round refreshed) fed only the kept tokens the way the
    decoder feeds them: the pending token(s) in one forward, then each kept draft alone. ``check_target(chunks)``
    gets the target's kept tokens so far, one chunk per forward (the prompt, then each round's 1 + accepted).
    Attention-only drafts; every round must draft (k > 0: max_new_tokens leaves room). Returns the rounds'
    accepted counts."""
    from rift_ada.refresh.base import refresh_wanted

    dec.reset(prompt, new_tokens)
    chunks = [list(prompt)]
    while not dec.done:
        seen_before, fed_before, before = prompt + dec.result.tokens, dec.dcache.length, dec.dcache.clone()
        rec = dec.step(refresh_wanted(controller, dec.state))
        assert rec.draft_length > 0, "a round without drafts feeds the draft nothing: give max_new_tokens room"
        seen = prompt + dec.result.tokens
        new = seen[len(seen_before):]
        chunks.append(seen_before[-1:] + new[:rec.accepted])
        assert dec.tcache.get_seq_length() == len(seen) - 1
        assert dec.dcache.length == len(seen) - (2 if rec.accepted == rec.draft_length > 0 else 1)
        if rec.refreshed:
            before.refresh()
        feed(dec.draft, before, seen_before[fed_before:])
        for t in new[:min(rec.accepted, rec.draft_length - 1)]:
            feed(dec.draft, before, [t])
        before.rollback(0)
        assert_same_layers(dec.dcache, before)
        if check_target is not None:
            check_target(chunks)
    return [r.accepted for r in dec.result.rounds]


def recompute(model, chunks, record_past=False):
    """The model's own cache fed ``chunks`` one forward each; ``record_past`` as the decoder's target cache (its
    sliding layers and conv states take the recorded path) and trimmed after each forward as the decoder trims it."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, chunk in enumerate(chunks):
        feed(model, cache, chunk, False)
        if record_past:
            if i == 0:
                cache.activate_past_recording()
            cache.crop(0)
    return cache


def script_module(name: str):
    """experiments/<name>.py as a module (its main is not run), loaded by path: the scripts import only installed
    packages, so no sys.path edit is needed."""
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]
