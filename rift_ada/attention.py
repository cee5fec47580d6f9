"""The attention function that records observation queries, registered through transformers' AttentionInterface.

A model switched to ``attn_implementation="rift_sdpa"`` computes exactly what ``"sdpa"`` computes. When a forward is
called with ``rift_observer=<RiftCache>``, each layer's post-RoPE queries are handed to that cache first, already
rotated at their own absolute positions (so scoring later needs no re-rotation, unlike kvpress's decode-time SnapKV).
Without the keyword it is plain SDPA, so one model object can serve as its own draft (observed) and target (not).

Two registrations are needed: the attention function, and the *mask* function under the same name. transformers
builds no mask for an unknown name, and SDPA then treats ``q > 1`` as top-left causal and slices the keys to the
first ``q`` entries: silently wrong output for a multi-token forward over a cache.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "rift_sdpa"


def rift_sdpa_attention(module, query, key, value, attention_mask, rift_observer=None, **kwargs):
    if rift_observer is not None:
        rift_observer.observe_queries(module.layer_idx, query, kwargs.get("position_ids"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTN_NAME, rift_sdpa_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def use_rift_attention(model) -> None:
    """Switch a loaded model to the observing attention (idempotent; same numbers as SDPA)."""
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
