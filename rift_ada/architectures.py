"""Which model architectures rift-ada handles, and the one check that refuses the others.

A model is supported when every layer of its cache is a full-attention or a sliding-window KV layer (as transformers
itself dispatches them: ``cache_utils.get_layer_types_and_kwargs``) and its attention goes through transformers'
``AttentionInterface`` with a ``layer_idx`` on each attention module (checked by a one-token probe,
``rift_ada.attention.check_observable``). Hybrid linear-attention / Mamba layers keep recurrent state that ``crop``
cannot roll back; they are refused here (a later issue).

``FAMILIES`` is the tested matrix: each entry builds a tiny random-init model from transformers' own config class.
``tests/test_architectures.py`` runs every family, and ``python experiments/architectures_table.py`` prints the
README's table from this list, so the list, the tests and the table cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """A model whose cache layers or attention rift-ada cannot handle; the message is one line naming what."""


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: None for a full-attention layer, the window in tokens for a sliding-window layer.
    UnsupportedModelError for any other layer type (linear attention, Mamba, chunked, shared KV, ...)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text)
    other = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
    if other:
        hybrid = " (hybrid linear-attention / Mamba models are not supported yet)" if any(
            t in ("linear_attention", "conv", "hybrid", "hybrid_sliding") for t in other) else ""
        raise UnsupportedModelError(
            f"{getattr(text, 'model_type', type(text).__name__)}: cache layers of type {', '.join(other)} are not "
            f"supported; rift-ada handles {' and '.join(SUPPORTED_LAYER_TYPES)} layers{hybrid}")
    return [kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(types, kwargs)]


# --- the tested matrix ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    name: str  # as the README's table names it
    key: str  # test id
    build: Callable[..., object]  # (vocab, layers, hidden, heads, kv_heads, window, init) -> a transformers config
    kv_layers: str  # which kinds of KV layers it has, for the table
    notes: str = ""

    def config(self, vocab: int = 128, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               window: int = 16, init: float = 0.2):
        return self.build(vocab=vocab, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, window=window,
                          init=init)

    def model(self, seed: int = 0, **size):
        """A random-init causal LM in eval mode (the model class is the config's ``AutoModelForCausalLM`` entry)."""
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(self.config(**size)).eval()


def _common(vocab, layers, hidden, heads, kv_heads, init, head_dim=True):
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
              initializer_range=init, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if head_dim:
        kw["head_dim"] = hidden // heads
    return kw


def _llama(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(vocab, layers, hidden, heads, kv_heads, init))


def _qwen3(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import Qwen3Config

    return Qwen3Config(**_common(vocab, layers, hidden, heads, kv_heads, init))


def _qwen3_swa(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import Qwen3Config

    # Layers from max_window_layers on slide (Qwen3's own rule): the upper half here.
    return Qwen3Config(**_common(vocab, layers, hidden, heads, kv_heads, init), use_sliding_window=True,
                       sliding_window=window, max_window_layers=layers // 2)


def _mistral(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import MistralConfig

    return MistralConfig(**_common(vocab, layers, hidden, heads, kv_heads, init), sliding_window=None)


def _mistral_swa(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import MistralConfig

    return MistralConfig(**_common(vocab, layers, hidden, heads, kv_heads, init), sliding_window=window)


def _phi3(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import Phi3Config

    return Phi3Config(**_common(vocab, layers, hidden, heads, kv_heads, init, head_dim=False))


def _gemma3(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import Gemma3TextConfig

    kw = _common(vocab, layers, hidden, heads, kv_heads, init)
    kw.update(query_pre_attn_scalar=kw["head_dim"])
    return Gemma3TextConfig(**kw, sliding_window=window,
                            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])


def _olmo2(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import Olmo2Config

    return Olmo2Config(**_common(vocab, layers, hidden, heads, kv_heads, init, head_dim=False))


def _granite(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import GraniteConfig

    return GraniteConfig(**_common(vocab, layers, hidden, heads, kv_heads, init, head_dim=False))


def _gpt_oss(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import GptOssConfig

    kw = _common(vocab, layers, hidden, heads, kv_heads, init)
    kw["intermediate_size"] = hidden
    # GPT-OSS alternates sliding and full layers (its own default); 4 experts, 2 per token keep it tiny.
    return GptOssConfig(**kw, sliding_window=window, num_local_experts=4, num_experts_per_tok=2)


FAMILIES: list[Family] = [
    Family("Llama", "llama", _llama, "full"),
    Family("Qwen3", "qwen3", _qwen3, "full", "q/k norm"),
    Family("Qwen3 with SWA layers", "qwen3-swa", _qwen3_swa, "full + sliding (`use_sliding_window`; layers from "
           "`max_window_layers` on)", "sliding layers in part of the stack only: the draft cache marks them, so transformers "
           "sizes the sliding mask from a sliding layer"),
    Family("Mistral", "mistral", _mistral, "full (`sliding_window=None`)"),
    Family("Mistral with a window", "mistral-swa", _mistral_swa, "all sliding (`sliding_window`)",
           "no full-attention layer: the RIFT budget has nothing to compress, the window bounds the draft's KV"),
    Family("Phi-3", "phi3", _phi3, "full", "fused qkv projection"),
    Family("Gemma 3 (text, `Gemma3ForCausalLM`)", "gemma3", _gemma3, "sliding / full alternating (`layer_types`)",
           "local and global RoPE bases, scaled embeddings"),
    Family("OLMo 2", "olmo2", _olmo2, "full", "q/k norm over the whole projection"),
    Family("Granite", "granite", _granite, "full", "embedding / attention / residual multipliers"),
    Family("GPT-OSS", "gpt-oss", _gpt_oss, "sliding / full alternating",
           "attention sinks, which SDPA cannot express: the observer wraps GPT-OSS's own eager attention; "
           "mixture of experts"),
]


def family(key: str) -> Family:
    for f in FAMILIES:
        if f.key == key:
            return f
    raise KeyError(f"unknown family {key!r}; choose one of {', '.join(f.key for f in FAMILIES)}")
