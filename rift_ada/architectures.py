"""Which model architectures rift-ada handles, and the one check that refuses the others.

A model is supported when every layer of its cache is one of the kinds below (as transformers itself dispatches them:
``cache_utils.get_layer_types_and_kwargs``), it has at least one attention layer, and its attention goes through
transformers' ``AttentionInterface`` with a ``layer_idx`` on each attention module (checked by a one-token probe,
``rift_ada.attention.check_observable``):

- ``full``: full attention (``full_attention``), a KV cache under the RIFT budget in the draft;
- ``sliding``: a sliding window (``sliding_attention``), the model's own window in both caches;
- ``state``: linear attention / Mamba (``linear_attention``: Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2), a
  fixed-size conv + recurrent state that is exact and never compressed; a rollback restores it from a checkpoint
  (``rift_ada.recurrent``), since a recurrent state cannot be cropped;
- ``none``: a layer without any cache (Nemotron-H's MLP and MoE blocks).

``FAMILIES`` is the tested matrix: each entry builds a tiny random-init model from transformers' own config class.
``tests/test_architectures.py`` runs every family, and ``python experiments/architectures_table.py`` prints the
README's table from this list, so the list, the tests and the table cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# transformers' cache layer type -> rift-ada's layer kind
KINDS = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "state"}
NO_CACHE_BLOCKS = ("mlp", "moe")  # blocks transformers gives a DummyLayer because they keep nothing


class UnsupportedModelError(ValueError):
    """A model whose cache layers or attention rift-ada cannot handle; the message is one line naming what."""


@dataclass(frozen=True)
class LayerKind:
    kind: str  # "full", "sliding", "state" or "none"
    window: int | None = None  # sliding layers: the model's window in tokens
    states: int = 1  # state layers: how many conv/recurrent state pairs the layer keeps


def layer_kinds(config) -> list[LayerKind]:
    """One :class:`LayerKind` per decoder layer. UnsupportedModelError for any other cache layer type (chunked,
    shared KV, layers mixing attention and a state in one, ...) and for a model without an attention layer."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    name = getattr(text, "model_type", type(text).__name__)
    types, kwargs = get_layer_types_and_kwargs(text)
    raw = list(getattr(text, "layer_types", None) or types)
    kinds, other = [], set()
    for t, kw, r in zip(types, kwargs, raw):
        if t in KINDS:
            kinds.append(LayerKind(KINDS[t], kw.get("sliding_window"), kw.get("number_of_states", 1)))
        elif t == "dummy" and r in NO_CACHE_BLOCKS:
            kinds.append(LayerKind("none"))
        else:
            other.add(t if t != "dummy" else "dummy (shared KV)")
    if other:
        raise UnsupportedModelError(
            f"{name}: cache layers of type {', '.join(sorted(other))} are not supported; rift-ada handles "
            f"{', '.join(KINDS)} layers and cache-free {'/'.join(NO_CACHE_BLOCKS)} blocks")
    if not any(k.kind in ("full", "sliding") for k in kinds):
        raise UnsupportedModelError(f"{name}: no attention layer (every layer keeps a recurrent state): there is no "
                                    "KV cache for rift-ada to compress")
    return kinds


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


def _qwen3_5(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import Qwen3_5TextConfig

    # Qwen3.5's own pattern (full attention every 4th layer, Gated DeltaNet elsewhere), with the last layer always
    # attention so that a 2-layer draft has a KV cache too.
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    types[-1] = "full_attention"
    return Qwen3_5TextConfig(**_common(vocab, layers, hidden, heads, kv_heads, init), layer_types=types,
                             linear_num_key_heads=kv_heads, linear_num_value_heads=heads,
                             linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads)


def _nemotron_h(vocab, layers, hidden, heads, kv_heads, window, init):
    from transformers import NemotronHConfig

    # Nemotron-H's blocks hold one thing each: Mamba-2 mixers and attention at even positions (attention at every
    # second mixer; the last block if there is no other), MoE / MLP blocks after them (no cache at all).
    types = ["full_attention" if i % 4 == 2 else "linear_attention" if i % 2 == 0 else "moe" if i % 4 == 1
             else "mlp" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    kw = _common(vocab, layers, hidden, heads, kv_heads, init)
    kw.pop("num_hidden_layers")  # the block list sets the depth
    return NemotronHConfig(**kw, layers_block_type=types, mamba_num_heads=heads, mamba_head_dim=hidden // heads,
                           ssm_state_size=16, n_groups=kv_heads, conv_kernel=4, chunk_size=16, n_routed_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                           moe_shared_expert_intermediate_size=hidden // 2)


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
    Family("Qwen3.5 (text, `Qwen3_5ForCausalLM`)", "qwen3_5", _qwen3_5,
           "full every 4th layer (`layer_types`); the others Gated DeltaNet linear attention (conv + recurrent state)",
           "hybrid: the budget compresses the attention layers only; gated attention output, q/k norm, partial RoPE"),
    Family("Nemotron-H", "nemotron_h", _nemotron_h,
           "full in some blocks (`layers_block_type`); Mamba-2 blocks (conv + SSM state); MLP / MoE blocks (none)",
           "hybrid; attention without RoPE (the Mamba layers carry position); mixture of experts"),
]


def family(key: str) -> Family:
    for f in FAMILIES:
        if f.key == key:
            return f
    raise KeyError(f"unknown family {key!r}; choose one of {', '.join(f.key for f in FAMILIES)}")
