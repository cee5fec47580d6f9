"""A static-shape draft step: one token through the draft, attending over a RIFT cache's fixed active buffers.

A RIFT draft cache has a fixed token budget, so its active KV (``RiftLayer._k`` / ``_v``: the budget plus
``ROUND_SLACK`` slots, preallocated) has the same shape at every context length. ``StaticDraftStep`` runs the draft's
layers as plain tensor code (gpt-fast's ``generate.py`` shape): it writes the new token's key and value into slot
``n_active`` of every layer's buffer, attends over the *whole* buffer under a validity mask (slot <= n_active), and
returns the logits with each layer's post-RoPE query. Every input has the same shape at every step (one token, a
position, a slot, a ``(1, capacity)`` mask), so ``torch.compile(fullgraph=True)`` makes one graph that serves a
whole generation at any context length, and on CUDA ``mode="reduce-overhead"`` replays it as a CUDA graph. The
bookkeeping (store append, observation queries, counts) stays in ``RiftLayer.commit`` / ``observe``, outside the
graph, and refresh rewrites the buffers in place, so a refresh costs no recompilation either.

Supported: decoder-only Llama-family drafts whose every layer is full attention (Llama, Mistral without a window,
Qwen2, Qwen3), under a RIFT layout; anything else is refused in one line and drafts through the model's own
forward. The step computes what the model's forward computes (tested against it to 1e-5); the target verifies
every draft token, so the output is the target's whatever the draft step computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .architectures import UnsupportedModelError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def _inner(model):
    """(decoder stack, lm_head) of a CausalLM, through a peft wrapper if there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model, base.lm_head


def check_static(model, cache) -> None:
    """Refuse, in one line, a draft or cache the static step cannot run."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise UnsupportedModelError(f"the static (compiled) draft step runs {', '.join(SUPPORTED)} drafts; "
                                    f"{cfg.model_type} drafts through its own forward (leave --compile off)")
    if cache is not None and len(cache.rift_layers) != len(cache.layers):
        raise UnsupportedModelError("the static (compiled) draft step needs every draft layer to be full attention "
                                    "(this draft has sliding-window or recurrent layers: leave --compile off)")
    if model.config._attn_implementation not in ("rift_sdpa", "sdpa"):
        raise UnsupportedModelError(f"the static (compiled) draft step computes SDPA attention; the draft runs "
                                    f"{model.config._attn_implementation}")


class StaticDraftStep:
    """``step(cache, token, position) -> logits (vocab,)``: one draft token over a :class:`RiftCache`, its cache
    updated as the model's own forward with ``rift_observer=cache`` would leave it. ``compile=True`` compiles the
    tensor part (``fullgraph``: a graph break is an error, not a silent slowdown)."""

    def __init__(self, model, compile: bool = False):
        self.model = model
        self.inner, self.lm_head = _inner(model)
        self.compiled = compile
        fn = self._forward
        if compile:
            mode = "reduce-overhead" if model.device.type == "cuda" else None
            fn = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)
        self.fn = fn

    def _forward(self, ids, pos, slot, mask, keys: list[torch.Tensor], values: list[torch.Tensor]):
        inner = self.inner
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        queries = []
        for layer, kb, vb in zip(inner.layers, keys, values):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            kb.index_copy_(2, slot, k)
            vb.index_copy_(2, slot, attn.v_proj(x).view(shape).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, kb, vb, attn_mask=mask, scale=attn.scaling,
                                               enable_gqa=q.shape[1] != kb.shape[1])
            h = h + attn.o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            queries.append(q)
        return self.lm_head(inner.norm(h))[0, -1], queries

    def inputs(self, cache, token: int, position: int):
        """The step's tensors: the same shapes at every step (what the compiled graph is specialised on)."""
        layers = cache.rift_layers
        n = layers[0].n_active
        for layer in layers:
            layer.reserve(n + 1)  # a no-op inside the budget; growing it changes the shape (one recompile)
        device = layers[0].keys.device
        ids = torch.tensor([[token]], device=device)
        pos = torch.tensor([[position]], device=device)
        slot = torch.tensor([n], device=device)
        mask = (torch.arange(layers[0].capacity, device=device) <= n)[None, None, None]
        return ids, pos, slot, mask, [layer._k for layer in layers], [layer._v for layer in layers]

    @torch.inference_mode()
    def __call__(self, cache, token: int, position: int) -> torch.Tensor:
        ids, pos, slot, mask, keys, values = self.inputs(cache, token, position)
        logits, queries = self.fn(ids, pos, slot, mask, keys, values)
        for layer, q in zip(cache.rift_layers, queries):
            layer.commit(1)
            layer.observe(q, pos[0])
        return logits
