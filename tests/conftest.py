import functools
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)  # tiny models: threads only add overhead


# Tests that need *a* real trained pair use the trained testbed models alone (``testbed-lm``): the shipped pair
# composes a hand-set copier beside them and costs about ten times the compute. Tests of the shipped pair's own
# figures (tests/test_regression.py, tests/test_testbed_check.py, tests/test_composed.py) load ``testbed``.
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
def _testbed_pair(drafter: str):
    from rift_ada.models import load_pair

    return load_pair(LM_TARGET, "testbed-lm" if drafter == "testbed" else drafter)


@functools.lru_cache(maxsize=None)
def _train_prompts(prompts: int, input_tokens: int) -> tuple:
    from rift_ada.data import build_tasks, encode_prompts

    tok = _testbed_pair("self").tokenizer
    tasks = build_tasks(tok, "low", n=prompts, input_tokens=input_tokens, seed=0, split="train")
    return tuple(tuple(p) for p in encode_prompts(tok, tasks))


def env_kw(budget: int = 128, input_tokens: int = 1024, prompts: int = 2, max_new_tokens: int = 40,
           drafter: str = "self") -> dict:
    """What a RefreshEnv is handed: a fresh decoder (self-speculation on the testbed, a RIFT layout; the models are
    shared) and encoded training-split `low` prompts. Each env gets its own decoder: they hold decoding state."""
    from rift_ada.layout import CacheLayout
    from rift_ada.speculative import SpeculativeDecoder

    pair = _testbed_pair(drafter)
    dec = SpeculativeDecoder(pair.target, None if pair.self_speculative else pair.draft, CacheLayout("rift", budget),
                             eos_token_id=pair.tokenizer.eos_token_id)
    return dict(decoder=dec, prompts=_train_prompts(prompts, input_tokens), max_new_tokens=max_new_tokens)
