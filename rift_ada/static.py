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


def check_static(model, role: str = "draft") -> None:
    """Refuse, in one line, a model (``role``: draft or target) the static step cannot run. Every layer full
    attention means every layer of the draft's cache is a RIFT layer (``RiftCache.for_config``)."""
    from .architectures import layer_kinds

    cfg, what = model.config, f"the static (compiled) {role} step"
    off = "--draft-step model" if role == "draft" else "--verify-step model"
    if cfg.model_type not in SUPPORTED:
        raise UnsupportedModelError(f"{what} runs {', '.join(SUPPORTED)} models; {cfg.model_type} runs its own "
                                    f"forward ({off})")
    kinds = {k.kind for k in layer_kinds(cfg)}
    if kinds != {"full"}:
        raise UnsupportedModelError(f"{what} needs every layer to be full attention (this {role} has sliding-window "
                                    f"or recurrent layers: {off})")
    if cfg._attn_implementation not in ("rift_sdpa", "sdpa"):
        raise UnsupportedModelError(f"{what} computes SDPA attention; the {role} runs {cfg._attn_implementation}")


def static_steps(draft, target, draft_step: str, verify_step: str, block: int):
    """(the draft's :class:`StaticDraftStep`, the target's :class:`StaticVerify` over blocks of ``block`` tokens)
    as ``draft_step`` / ``verify_step`` ask ("static", "compiled"), each None for "model" (the model's own forward);
    a model a static step cannot run is refused in one line."""
    step = verify = None
    if draft_step != "model":
        check_static(draft)
        step = StaticDraftStep(draft, compile=draft_step == "compiled")
    if verify_step != "model":
        check_static(target, role="target")
        verify = StaticVerify(target, block, compile=verify_step == "compiled")
    return step, verify


def grouped_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """Attention of ``q`` (b, heads, n, d) over ``k``/``v`` (b, kv_heads, slots, d) under ``mask`` (1, 1, n, slots),
    the query heads that share a KV head folded into its rows: (b, kv_heads, groups * n, d). The same numbers as
    ``enable_gqa=True``, but the CPU kernel then reads each KV head once for its whole group instead of a copy per
    query head: at 7K context one target layer's attention of 1-4 queries costs 11.5-13.5 ms folded against
    17.6-24.8 ms (experiments/bench_attention.py), which makes a verify of a few drafts cost about a plain step."""
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    if heads == kv_heads:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    groups = heads // kv_heads
    folded = q.reshape(b, kv_heads, groups * n, d)  # row g * n + t: query head kv * groups + g, token t
    o = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.repeat(1, 1, groups, 1), scale=scale)
    return o.view(b, heads, n, d)


class _StaticForward:
    """The model's forward as plain tensor code over caller-owned KV buffers; ``compile=True`` compiles it
    (``fullgraph``: a graph break is an error, not a silent slowdown)."""

    def __init__(self, model, compile: bool = False):
        self.model = model
        self.inner, self.lm_head = _inner(model)
        self.compiled = compile
        fn = self._forward
        if compile:
            # One graph per (model, cache shape) by design: each draft, and each prompt length of a cache that holds
            # the prompt (the verify's, a full draft's). Dynamo's default of 8 per code object would silently fall
            # back to eager in a bench over several lengths.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
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
            o = grouped_attention(q, kb, vb, mask, attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            queries.append(q)
        return self.lm_head(inner.norm(h))[0], queries


class StaticDraftStep(_StaticForward):
    """``step(cache, token, position) -> logits (vocab,)``: one draft token over a :class:`RiftCache`, its cache
    updated as the model's own forward with ``rift_observer=cache`` would leave it."""

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
        slots = torch.arange(layers[0].capacity, device=device)
        mask = slots <= n
        window = layers[0].window
        if window is not None:  # tail slot s holds position ``position - (n - s)``: the window band of RiftLayer.window_mask
            mask &= (slots < layers[0].n_imp) | (slots >= n - window)
        mask = mask[None, None, None]
        return ids, pos, slot, mask, [layer._k for layer in layers], [layer._v for layer in layers]

    @torch.inference_mode()
    def __call__(self, cache, token: int, position: int) -> torch.Tensor:
        ids, pos, slot, mask, keys, values = self.inputs(cache, token, position)
        logits, queries = self.fn(ids, pos, slot, mask, keys, values)
        for layer, q in zip(cache.rift_layers, queries):
            layer.commit(1)
            layer.observe(q, pos[0])
        return logits[-1]

    def feed(self, cache, tokens: list[int]) -> torch.Tensor:
        """The draft's logits after ``tokens`` (one step per token: one shape, so one compiled graph)."""
        for token in tokens:
            logits = self(cache, token, cache.length)
        return logits

    @staticmethod
    def prepare(cache, capacity: int) -> None:
        """Before a generation of at most ``capacity`` tokens in all: a cache that grows with the context (full,
        snapkv: no tail limit) makes room for all of them now, so its shape holds for this prompt (a compiled step
        compiles once per prompt length; a RIFT budget's shape is the same at every length)."""
        if cache.layout.tail_limit is None:
            for layer in cache.rift_layers:
                layer.reserve(capacity)


class StaticKV:
    """The target's KV cache in fixed buffers (b, kv_heads, capacity, d) per layer, for the static verify: slot =
    position. ``crop(-n)`` only moves ``length`` back (entries past it are invisible under the causal mask and
    rewritten before any query can see them). Built from the prefilled cache, sized for the whole generation."""

    layers: list = []  # no linear-attention states (rift_ada.recurrent.TargetStates finds none)

    def __init__(self, cache, capacity: int):
        self.length = cache.get_seq_length()
        self.keys, self.values = [], []
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            self.keys.append(k.new_zeros(*k.shape[:2], capacity, k.shape[-1]))
            self.values.append(v.new_zeros(*v.shape[:2], capacity, v.shape[-1]))
            self.keys[-1][:, :, :self.length], self.values[-1][:, :, :self.length] = k, v

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        self.length += min(tokens_to_remove, 0)


class StaticVerify(_StaticForward):
    """``verify(cache, tokens) -> logits (len(tokens), vocab)``: the target's verify forward over a
    :class:`StaticKV`. Compiled, it is a fixed block of ``block`` tokens (a shorter round is padded; the padding's
    logits are dropped and its entries lie past ``length``), so it has one shape per cache capacity; eager, a round
    of fewer tokens runs on just those (a round that drafts less, or a plain target step, costs less)."""

    def __init__(self, model, block: int, compile: bool = False):
        super().__init__(model, compile)
        self.block = block
        self.pad = compile  # every round padded to the block: one input shape per cache capacity (a graph's need)

    def inputs(self, cache: StaticKV, tokens: list[int]):
        device = cache.keys[0].device
        width = self.block if self.pad else len(tokens)
        ids = torch.zeros(1, width, dtype=torch.long, device=device)
        ids[0, :len(tokens)] = torch.tensor(tokens, device=device)
        pos = torch.arange(cache.length, cache.length + width, device=device)
        mask = torch.arange(cache.keys[0].shape[2], device=device)[None] <= pos[:, None]
        return ids, pos[None], pos, mask[None, None], cache.keys, cache.values

    @torch.inference_mode()
    def __call__(self, cache: StaticKV, tokens: list[int]) -> torch.Tensor:
        if len(tokens) > self.block:
            raise ValueError(f"a verify block holds {self.block} tokens, got {len(tokens)}")
        logits, _ = self.fn(*self.inputs(cache, tokens))
        cache.length += len(tokens)
        return logits[:len(tokens)]
