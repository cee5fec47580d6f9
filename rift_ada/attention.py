"""The attention function that records observation queries, registered through transformers' AttentionInterface.

A model switched to ``attn_implementation="rift_sdpa"`` computes exactly what ``"sdpa"`` computes. When a forward is
called with ``rift_observer=<RiftCache>``, each layer's post-RoPE queries are handed to that cache first, already
rotated at their own absolute positions (so scoring later needs no re-rotation, unlike kvpress's decode-time SnapKV).
Without the keyword it is plain SDPA, so one model object can serve as its own draft (observed) and target (not).
With ``rift_masks=[per-layer (batch, kv_heads, q, k) bool]`` a full-sequence forward attends under those masks
instead (compressibility training: what a compressed cache shows each token, per KV head).

Two registrations are needed: the attention function, and the *mask* function under the same name. transformers
builds no mask for an unknown name, and SDPA then treats ``q > 1`` as top-left causal and slices the keys to the
first ``q`` entries: silently wrong output for a multi-token forward over a cache.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "rift_sdpa"


def rift_sdpa_attention(module, query, key, value, attention_mask, rift_observer=None, rift_masks=None, **kwargs):
    if rift_observer is not None:
        rift_observer.observe_queries(module.layer_idx, query, kwargs.get("position_ids"))
    if rift_masks is not None:
        return masked_attention(module, query, key, value, rift_masks[module.layer_idx])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def masked_attention(module, query, key, value, mask):
    """SDPA under an explicit per-KV-head boolean mask (batch, kv_heads, q, k), True = may attend. This is how the
    compressibility trainer makes a full-sequence pass see exactly what the compressed cache shows each token."""
    g = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), attn_mask=mask.repeat_interleave(g, 1),
        scale=module.scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, rift_sdpa_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def use_rift_attention(model) -> None:
    """Switch a loaded model to the observing attention (idempotent; same numbers as SDPA)."""
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
