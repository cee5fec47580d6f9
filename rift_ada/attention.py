"""Observing attention functions, registered through transformers' AttentionInterface.

Each observer wraps one base implementation and computes exactly what it computes: ``rift_sdpa`` wraps ``sdpa``,
``rift_eager`` the model's *own* eager function (GPT-OSS's adds its attention sinks, Gemma's its softcapping), and
``rift_flex_attention`` flex attention. ``use_rift_attention(model)`` switches a model to the observer of the
implementation it runs (a model without SDPA support, such as GPT-OSS, loads with eager and gets ``rift_eager``).
When a forward is called with ``rift_observer=<RiftCache>``, each layer's post-RoPE queries are handed to that cache
first, already rotated at their own absolute positions (so scoring later needs no re-rotation, unlike kvpress's
decode-time SnapKV). Without the keyword the observer is its base, so one model object can serve as its own draft
(observed) and target (not). With ``rift_masks=[per-layer (batch, kv_heads, q, k) bool]`` a full-sequence forward
attends under those masks instead (compressibility training: what a compressed cache shows each token, per KV
head); that path is SDPA on full-attention layers only and refuses anything else.

Two registrations per observer: the attention function, and the *mask* function of its base under the same name.
transformers builds no mask for an unknown name, and SDPA then treats ``q > 1`` as top-left causal and slices the
keys to the first ``q`` entries: silently wrong output for a multi-token forward over a cache.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, flex_attention_mask, sdpa_mask

from .architectures import UnsupportedModelError

PREFIX = "rift_"
# base implementation -> (its attention function, None = the model's own eager; its mask function)
BASES = {
    "sdpa": (sdpa_attention_forward, sdpa_mask),
    "eager": (None, eager_mask),
    "flex_attention": (flex_attention_forward, flex_attention_mask),
}
OBSERVERS = {base: PREFIX + base for base in BASES}


def _layer_idx(module) -> int:
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int):
        raise UnsupportedModelError(f"{type(module).__name__} has no integer layer_idx: rift-ada cannot tell which "
                                    "cache layer its queries belong to")
    return idx


def _model_eager(module):
    """The eager function the module's own modeling file defines: what ``attn_implementation="eager"`` runs."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise UnsupportedModelError(f"{type(module).__module__} defines no eager_attention_forward for "
                                    f"{type(module).__name__} to wrap")
    return fn


def _observer(base: str):
    fn = BASES[base][0]

    def attention(module, query, key, value, attention_mask, rift_observer=None, rift_masks=None, **kwargs):
        if rift_observer is not None:
            rift_observer.observe_queries(_layer_idx(module), query, kwargs.get("position_ids"))
            window = getattr(rift_observer, "window_mask", None)
            window = window(_layer_idx(module), query.shape[2]) if window is not None else None
            if window is not None:
                attention_mask = _restrict(attention_mask, window, query.dtype, base)
        if rift_masks is not None:
            return masked_attention(module, query, key, value, rift_masks[_layer_idx(module)], base=base, **kwargs)
        return (fn or _model_eager(module))(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{PREFIX}{base}_attention"
    return attention


def _restrict(mask, allowed: torch.Tensor, dtype, base: str):
    """The model's mask further limited to ``allowed`` (q, kv) bool (the RIFT cache's sliding window, which encodes
    causality itself): a boolean mask is AND-ed, an additive one gets -inf where not allowed, none (SDPA's causal
    shortcut) is replaced; flex attention takes it as an additive score mask instead of its BlockMask."""
    if base != "flex_attention" and isinstance(mask, torch.Tensor):
        if mask.dtype == torch.bool:
            return mask & allowed
        return mask.masked_fill(~allowed, torch.finfo(mask.dtype).min)
    if base != "flex_attention" and mask is None:
        return allowed[None, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[None, None]


def masked_attention(module, query, key, value, mask, base: str = "sdpa", **kwargs):
    """SDPA under an explicit per-KV-head boolean mask (batch, kv_heads, q, k), True = may attend. This is how the
    compressibility trainer makes a full-sequence pass see exactly what the compressed cache shows each token.
    Only for SDPA-compatible full-attention layers: the mask would silently drop attention sinks, softcapping or a
    sliding window."""
    if base != "sdpa" or kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        raise UnsupportedModelError(f"masked attention (compressibility training) runs SDPA; {type(module).__name__} "
                                    f"attends with {base} (attention sinks or softcapping): not supported")
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedModelError(f"masked attention (compressibility training) models full-attention layers only; "
                                    f"layer {module.layer_idx} of {type(module).__name__} slides")
    g = query.shape[1] // key.shape[1]
    mask = mask.to(query.device)  # no-op unless the model is spread over devices (device_map)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), attn_mask=mask.repeat_interleave(g, 1),
        scale=module.scaling)
    return out.transpose(1, 2).contiguous(), None


for _base, (_, _mask) in BASES.items():
    AttentionInterface.register(OBSERVERS[_base], _observer(_base))
    AttentionMaskInterface.register(OBSERVERS[_base], _mask)


def observer_for(model) -> str:
    """The observer of the implementation ``model`` runs. Implementations no observer wraps (flash kernels) fall back
    to SDPA where the model supports it, else to its eager attention: same numbers, slower."""
    impl = model.config._attn_implementation
    if impl in OBSERVERS.values():
        return impl
    if impl in OBSERVERS:
        return OBSERVERS[impl]
    return OBSERVERS["sdpa" if getattr(model, "_supports_sdpa", False) else "eager"]


def use_rift_attention(model) -> None:
    """Switch a loaded model to the observing attention (idempotent; same numbers as its own implementation)."""
    name = observer_for(model)
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


class _Probe:
    def __init__(self):
        self.seen: list[int] = []

    def observe_queries(self, layer_idx, query, positions=None):
        self.seen.append(layer_idx)


@torch.no_grad()
def check_observable(model, kinds=None) -> None:
    """One one-token forward: every attention layer's attention must reach the observer with its ``layer_idx``
    (UnsupportedModelError otherwise, e.g. attention that bypasses AttentionInterface). Linear-attention / Mamba and
    cache-free layers have no attention to observe."""
    from .architectures import layer_kinds

    use_rift_attention(model)
    probe = _Probe()
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    model(ids, position_ids=torch.zeros_like(ids), use_cache=False, rift_observer=probe, logits_to_keep=1)
    kinds = layer_kinds(model.config) if kinds is None else kinds
    want = [i for i, k in enumerate(kinds) if k.kind in ("full", "sliding")]
    if sorted(probe.seen) != want:
        raise UnsupportedModelError(f"{type(model).__name__}: the attention of layers "
                                    f"{sorted(set(want) - set(probe.seen)) or sorted(probe.seen)} does not go "
                                    "through transformers' AttentionInterface, so rift-ada cannot observe it")
