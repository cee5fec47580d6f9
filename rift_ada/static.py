"""Static-shape steps: the draft's step over a RIFT cache's fixed buffers, the target's verify over a fixed block.

A RIFT draft cache has a fixed token budget, so its active KV (``RiftLayer.buffers``: the budget plus
``ROUND_SLACK`` slots) has the same shape at every context length. ``StaticDraftStep`` runs the draft's layers as
plain tensor code (gpt-fast's ``generate.py`` shape) over buffers it owns, at fixed addresses for its lifetime (a
:class:`DraftArena` per capacity, the cache's layers adopting them as views): one step writes the fed token's key and
value into slot ``n_active`` of every layer, its post-RoPE query into the observation log, attends over the whole
buffer under a validity mask built in the step, draws the next draft token (argmax, or the inverse CDF of one uniform
drawn once per round) and its entropy, and advances its own position and slot counters. Everything a step reads or
writes lives in those buffers, so a step has no per-step inputs at all: a round writes its start (positions, the
pending tokens, the uniforms) once, then replays the step k times. The bookkeeping that stays on the host (counts,
the backing store's copy of the round's entries) runs once per round.

Compiled (``torch.compile(fullgraph=True, dynamic=False)``; on CUDA ``mode="reduce-overhead"``), one graph serves a
whole generation at any context length, and since every buffer it writes is marked as a static input
(``torch._dynamo.mark_static_address``, at allocation, before the first compile), inductor replays it as a CUDA
graph: an in-place write to a graph input that is not static is what made it skip every graph before ("mutated
inputs"; ``tests/test_static.py`` runs inductor's own check on CPU). A refresh rewrites the same storage, so it costs
no recompilation and no re-capture.

The target's verify (``StaticVerify`` over a :class:`StaticKV`) is the same: its cache is one stacked buffer per
capacity owned by the verify, a block of ``k + 1`` tokens (a shorter round padded) written at their positions, the
positions and the causal mask built in the step from one start counter.

Supported: decoder-only Llama-family models whose every layer is full attention (Llama, Mistral without a window,
Qwen2, Qwen3); anything else is refused in one line and runs the model's own forward. The step computes what the
model's forward computes (tested against it to 1e-5); the target verifies every draft token, so the output is the
target's whatever the draft step computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .architectures import UnsupportedModelError
from .rounds import draw, entropy, sampling_probs

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
MAX_ROUND = 64  # draft tokens a round may hold (ROUND_SLACK: a round's tokens in flight)
NO_WINDOW = 1 << 40  # the window of a cache whose tail is never evicted: every stored slot in the band
# How the steps attend: "sdpa" (grouped_attention: scaled_dot_product_attention under the mask) or "matmul"
# (decode_attention: two matmuls and a masked softmax that inductor compiles and fuses); None: matmul on CUDA, SDPA
# elsewhere. With an explicit mask, CUDA's SDPA runs the memory-efficient kernel, which does not split the keys across
# thread blocks: a step's one query row per head (a verify's 12) over a long cache then occupies a few of the GPU's
# 132 SMs (by the kernel's design; unmeasured here). Two matmuls tile the key axis like any GEMM.
ATTENTION: str | None = None


def decoder_stack(model):
    """(decoder stack, lm_head) of a CausalLM, through a peft wrapper if there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model, base.lm_head


def check_static(model, role: str = "draft", kinds=None) -> None:
    """Refuse, in one line, a model (``role``: draft or target) the static step cannot run. Every layer full
    attention means every layer of the draft's cache is a RIFT layer (``RiftCache.for_config``)."""
    from .architectures import layer_kinds

    cfg, what = model.config, f"the static (compiled) {role} step"
    off = "--draft-step model" if role == "draft" else "--verify-step model"
    if cfg.model_type not in SUPPORTED:
        raise UnsupportedModelError(f"{what} runs {', '.join(SUPPORTED)} models; {cfg.model_type} runs its own "
                                    f"forward ({off})")
    kinds = {k.kind for k in (layer_kinds(cfg) if kinds is None else kinds)}
    if kinds != {"full"}:
        raise UnsupportedModelError(f"{what} needs every layer to be full attention (this {role} has sliding-window "
                                    f"or recurrent layers: {off})")
    if cfg._attn_implementation not in ("rift_sdpa", "sdpa"):
        raise UnsupportedModelError(f"{what} computes SDPA attention; the {role} runs {cfg._attn_implementation}")


def static_steps(draft, target, draft_step: str, verify_step: str, block: int, sampling=(0.0, 0, 1.0),
                 kinds=(None, None)):
    """(the draft's :class:`StaticDraftStep`, the target's :class:`StaticVerify` over blocks of ``block`` tokens)
    as ``draft_step`` / ``verify_step`` ask ("static", "compiled"), each None for "model" (the model's own forward);
    ``sampling``: (temperature, top_k, top_p) the draft step draws with. A model a static step cannot run is refused
    in one line. ``kinds``: the draft's and the target's ``layer_kinds`` when computed already."""
    step = verify = None
    if draft_step != "model":
        check_static(draft, kinds=kinds[0])
        step = StaticDraftStep(draft, compile=draft_step == "compiled", sampling=sampling)
    if verify_step != "model":
        check_static(target, role="target", kinds=kinds[1])
        verify = StaticVerify(target, block, compile=verify_step == "compiled")
    return step, verify


def static_buffer(shape, dtype, device, dynamic: int | None = None) -> torch.Tensor:
    """Zeros at a fixed address, marked as a static graph input before any compile sees it: inductor then lets a
    graph write it in place and still replays the graph (zeros, not empty: the steps attend over unfilled slots too,
    masked, and 0 x NaN would be NaN). ``dynamic``: the slot axis of a cache, compiled as a size the graph takes as
    an input, so one graph serves every capacity (a prompt length's verify, a full draft cache) and a CUDA graph is
    recorded per capacity instead of a compile. An inference tensor, as every buffer the steps write (a graph is
    specialised on that too: a normal tensor in its place would compile another)."""
    with torch.inference_mode():
        t = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(t, guard=False)
    if dynamic is not None:
        torch._dynamo.maybe_mark_dynamic(t, dynamic)
    return t


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


def decode_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """:func:`grouped_attention`'s numbers as two matmuls and a softmax in float32 (the models' eager attention), the
    query heads folded into their KV head's rows as there (no copy of the keys per query head)."""
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    folded = q.reshape(b, kv_heads, groups * n, d)
    scores = (folded @ k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask.repeat(1, 1, groups, 1), float("-inf"))
    return (scores.softmax(-1).to(v.dtype) @ v).view(b, heads, n, d)


def attention_for(device) -> str:
    """The attention the static steps run on ``device`` (``ATTENTION``, or its default there)."""
    return ATTENTION or ("matmul" if torch.device(device).type == "cuda" else "sdpa")


class StaticForward:
    """The model's forward as plain tensor code over caller-owned, stacked KV buffers (layers, b, kv_heads, slots,
    d); ``compile=True`` compiles ``step`` (``fullgraph``: a graph break is an error, not a silent slowdown)."""

    def __init__(self, model, step, compile: bool = False):
        self.model = model
        self.inner, self.lm_head = decoder_stack(model)
        self.compiled = compile
        self.attend = decode_attention if attention_for(model.device) == "matmul" else grouped_attention
        fn = step
        if compile:
            # One graph per model and step kind by design (the slot axis is a size the graph takes), but a process
            # may compile many models (the tests, a bench of several pairs): dynamo's default of 8 graphs per code
            # object would silently fall back to eager.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            mode = "reduce-overhead" if model.device.type == "cuda" else None
            fn = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)
        self.fn = fn

    def _forward(self, ids, pos, slot, mask, keys, values, qlog=None, qpos=None, qslot=None):
        """Logits at ``ids`` (1, n) fed at ``pos`` (1, n), their keys and values written at ``slot`` (n,) of every
        layer's ``keys[i]`` / ``values[i]``; with ``qlog``, each layer's post-RoPE queries written at ``qslot`` of
        ``qlog[i]`` and their positions into ``qpos[i]`` (the observation log scoring reads)."""
        return self._layers(ids, pos, slot, mask, keys, values, qlog, qpos, qslot)[0]

    def _layers(self, ids, pos, slot, mask, keys, values, qlog=None, qpos=None, qslot=None):
        """The forward itself, logits (b, n, vocab). ``slot`` / ``qslot``: (n,), the same slots for every row (one
        sequence), or (b, n), each row its own (a batch, ``rift_ada.static_batch``: written by a scatter per row);
        ``qpos[i]`` is then (b, log slots)."""
        inner = self.inner
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            _write(keys[i], slot, k)
            _write(values[i], slot, attn.v_proj(x).view(shape).transpose(1, 2))
            if qlog is not None:
                _write(qlog[i], qslot, q.to(qlog.dtype))
                if qslot.dim() == 1:
                    qpos[i].index_copy_(0, qslot, pos.reshape(-1))
                else:
                    qpos[i].scatter_(1, qslot, pos)
            o = self.attend(q, keys[i], values[i], mask, attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(inner.norm(h))


def _write(buf: torch.Tensor, slot: torch.Tensor, x: torch.Tensor) -> None:
    """``x`` (b, heads, n, d) into ``buf`` (b, heads, slots, d) at ``slot``: (n,) the same slots for every row, or
    (b, n) each row's own."""
    if slot.dim() == 1:
        buf.index_copy_(2, slot, x)
    else:
        buf.scatter_(2, slot[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]), x)


class DraftArena:
    """A draft step's buffers at one active capacity, allocated once and kept for the step's lifetime: keys and
    values (layers, b, kv_heads, capacity, d), the observation log's queries (layers, b, heads, log slots, d) and their
    positions (layers, log slots). A cache's RIFT layers adopt views of them (``RiftLayer.adopt``)."""

    def __init__(self, layers, capacity: int):
        k, q = layers[0].buffers[0], layers[0].log.buffer
        n = len(layers)
        self.capacity = capacity
        self.k = static_buffer((n, *k.shape[:2], capacity, k.shape[-1]), k.dtype, k.device, dynamic=3)
        self.v = static_buffer(self.k.shape, k.dtype, k.device, dynamic=3)
        self.q = static_buffer((n, *self._log_shape(layers)), q.dtype, q.device)
        self.qpos = static_buffer((n, self.q.shape[3]), torch.long, q.device)

    @staticmethod
    def _log_shape(layers):
        """The observation log's buffer: what it keeps between rounds and a round's queries in flight."""
        log = layers[0].log
        return (*log.buffer.shape[:2], log.capacity + MAX_ROUND, log.buffer.shape[-1])

    def fits(self, layers, capacity: int) -> bool:
        k, q = layers[0].buffers[0], layers[0].log.buffer
        return (capacity == self.capacity and self.k.shape[0] == len(layers) and self.k.shape[1:3] == k.shape[:2]
                and self.q.shape[1:] == self._log_shape(layers) and self.k.dtype == k.dtype
                and self.k.device == k.device and self.q.dtype == q.dtype)

    def adopt(self, layers) -> None:
        for i, layer in enumerate(layers):
            layer.adopt(self.k[i], self.v[i], self.q[i], self.qpos[i])

    def holds(self, layers) -> bool:
        """Whether every layer still writes into this arena (a layer that outgrew it reallocated its own buffer)."""
        return all(layer.buffers[0].data_ptr() == self.k[i].data_ptr() and layer.log.buffer.data_ptr() == self.q[i].data_ptr()
                   for i, layer in enumerate(layers))


class StaticDraftStep(StaticForward):
    """The draft's static step over a :class:`RiftCache` (``rift_ada.cache``). ``prepare(cache, capacity)`` after the
    prefill (the cache adopts this step's buffers); ``round(cache, pending, k)`` drafts k tokens on the device (no host
    read): feeds the pending tokens, then each draft but the last, and returns the drafts, the distributions they were
    drawn from (None when greedy) and the draft's entropy at each, as device tensors. ``cache`` is left as the model's
    own forward with ``rift_observer=cache`` would leave it (its backing store's copy of the round's entries waits
    for the round's end: ``RiftLayer.flush_store``). ``step(cache, token, position)``: one step, its logits."""

    def __init__(self, model, compile: bool = False, sampling=(0.0, 0, 1.0)):
        super().__init__(model, self._step, compile)
        self.temperature, self.top_k, self.top_p = sampling
        self._arenas: dict[int, DraftArena] = {}
        self.arena: DraftArena | None = None
        self.device = model.device
        # [position, slot, log slot, step in the round, first step that draws a draft, n_imp, window]: the step
        # reads and advances them itself, so a round's steps take no inputs of their own; a RIFT cache and a full one
        # (no window: NO_WINDOW) run the same graph.
        self.state = static_buffer((7,), torch.long, self.device)
        self.tokens = static_buffer((MAX_ROUND + 2,), torch.long, self.device)  # pending, then each draft
        self.uniforms = static_buffer((MAX_ROUND + 1,), torch.float64, self.device)
        self.entropies = static_buffer((MAX_ROUND,), torch.float32, self.device)
        vocab = model.config.vocab_size
        self.q_probs = static_buffer((MAX_ROUND, vocab) if self.temperature else (1, 1), torch.float32, self.device)

    def _step(self, state, tokens, uniforms, entropies, q_probs, keys, values, qlog, qpos):
        s = state.clone()  # the counters as this step found them
        pos, slot, qslot, j, first, n_imp, window = (s[i:i + 1] for i in range(7))
        slots = torch.arange(keys.shape[3], device=keys.device)
        # Tail slot s holds position ``pos - (slot - s)``: the importance part and RiftLayer.window_mask's band.
        mask = (slots <= slot) & ((slots < n_imp) | (slots >= slot - window))
        logits = self._forward(tokens.index_select(0, j)[None], pos[None], slot, mask[None, None, None], keys,
                               values, qlog, qpos, qslot)[-1]
        # Steps before ``first`` feed a pending token whose prediction is already known: they write nothing.
        keep, d = j >= first, (j - first).clamp_min(0)
        if self.temperature == 0:
            token = logits.argmax()[None]
        else:
            probs = sampling_probs(logits, self.temperature, self.top_k, self.top_p)
            token = draw(probs, uniforms.index_select(0, d))[None]
            q_probs.index_copy_(0, d, torch.where(keep, probs[None], q_probs.index_select(0, d)))
        entropies.index_copy_(0, d, torch.where(keep, entropy(logits)[None], entropies.index_select(0, d)))
        tokens.index_copy_(0, j + 1, torch.where(keep, token, tokens.index_select(0, j + 1)))
        state[:4] += 1
        return logits

    # --- a generation --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, cache, capacity: int) -> None:
        """After the prefill of a generation of at most ``capacity`` tokens in all, the cache's layers move into this
        step's buffers: of the budget's size under a RIFT budget (the same at every length), of ``capacity`` for a
        cache that grows with the context (full, snapkv: no tail limit), so its shape holds for the whole generation
        (a CUDA graph recorded per prompt length; the compiled graph is the same)."""
        self._adopt(cache, capacity if cache.layout.tail_limit is None else None)

    def _adopt(self, cache, capacity: int | None = None) -> None:
        layers = cache.rift_layers
        for layer in layers:
            layer.log.trim()  # a chunked prefill may leave more than the log keeps between rounds
        cap = max(capacity or 0, layers[0].capacity if capacity is None else layers[0].n_active)
        arena = self._arenas.get(cap)
        if arena is None or not arena.fits(layers, cap):
            arena = self._arenas[cap] = DraftArena(layers, cap)
        arena.adopt(layers)
        self.arena = arena

    def release(self) -> None:
        """Free the buffers of every capacity (a step serving one length at a time need not keep the others)."""
        self._arenas.clear()
        self.arena = None

    def _args(self):
        a = self.arena
        return (self.state, self.tokens, self.uniforms, self.entropies, self.q_probs, a.k, a.v, a.q, a.qpos)

    def _start(self, cache, pending: list[int], steps: int, generator=None, draws: int = 0) -> None:
        """Before ``steps`` steps: room for them, this step's buffers still the cache's, and the counters, the pending
        tokens and ``draws`` uniforms written once (one small copy to the device)."""
        layers = cache.rift_layers
        first = layers[0]
        for layer in layers:
            layer.reserve(first.n_active + steps)  # a no-op inside the budget; growing it means a new arena
        if self.arena is None or not self.arena.holds(layers):
            self._adopt(cache)
        window = NO_WINDOW if first.window is None else first.window
        start = [first.length, first.n_active, first.log.size, 0, len(pending) - 1, first.n_imp, window, *pending]
        host = torch.tensor(start, dtype=torch.long)
        dev = host.to(self.device, non_blocking=True)
        self.state.copy_(dev[:7])
        self.tokens[:len(pending)].copy_(dev[7:])
        if draws:
            self.uniforms[:draws].copy_(torch.rand(draws, generator=generator, device=self.device,
                                                   dtype=torch.float64))

    @staticmethod
    def _commit(cache, steps: int) -> None:
        for layer in cache.rift_layers:
            layer.advance(steps)

    @torch.inference_mode()
    def round(self, cache, pending: list[int], k: int, generator=None):
        """Draft ``k`` tokens after ``pending`` (1 or 2 tokens the draft has not read): (drafts (k,) long, their
        distributions (k, vocab) or None when greedy, the entropy at each draft (k,)), all on the device."""
        steps = len(pending) + k - 1
        if k > MAX_ROUND or len(pending) > 2:
            raise ValueError(f"a static round drafts at most {MAX_ROUND} tokens after 1 or 2 pending ones")
        self._start(cache, pending, steps, generator, k if self.temperature else 0)
        args = self._args()
        for _ in range(steps):
            self.fn(*args)
        self._commit(cache, steps)
        # Views of this step's buffers: read within the round, before the next round's steps rewrite them.
        p = len(pending)
        return self.tokens[p:p + k], self.q_probs[:k] if self.temperature else None, self.entropies[:k]

    @torch.inference_mode()
    def __call__(self, cache, token: int, position: int) -> torch.Tensor:
        """One step: ``token`` at ``position`` (the cache's length), its logits (vocab,)."""
        if position != cache.rift_layers[0].length:
            raise ValueError(f"a static step feeds the next position ({cache.rift_layers[0].length}), got {position}")
        self._start(cache, [token], 1, torch.Generator(device=self.device), 1 if self.temperature else 0)
        logits = self.fn(*self._args()).clone()
        self._commit(cache, 1)
        for layer in cache.rift_layers:  # one step, not a round: nothing waits for a round's end
            layer.flush_store()
        return logits

    def feed(self, cache, tokens: list[int]) -> torch.Tensor:
        """The draft's logits after ``tokens`` (one step per token: one shape, so one compiled graph)."""
        for token in tokens:
            logits = self(cache, token, cache.length)
        return logits


class StaticKV:
    """The target's KV cache in fixed buffers for the static verify: ``keys`` / ``values`` (layers, b, kv_heads,
    capacity, d), slot = position, ``keys[i]`` layer i's. ``crop(-n)`` only moves ``length`` back (entries past it
    are invisible under the causal mask and rewritten before any query can see them). Built from the prefilled
    cache, sized for the whole generation, in buffers the verify owns (``StaticVerify.cache``) or new ones."""

    layers: list = []  # no linear-attention states (rift_ada.recurrent.TargetStates finds none)

    def __init__(self, cache, capacity: int, buffers: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.length = cache.get_seq_length()
        first = cache.layers[0].keys
        if buffers is None:
            shape = (len(cache.layers), *first.shape[:2], capacity, first.shape[-1])
            buffers = (static_buffer(shape, first.dtype, first.device, dynamic=3),
                       static_buffer(shape, first.dtype, first.device, dynamic=3))
        self.keys, self.values = buffers
        for i, layer in enumerate(cache.layers):
            self.keys[i, :, :, :self.length] = layer.keys
            self.values[i, :, :, :self.length] = layer.values

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        self.length += min(tokens_to_remove, 0)


class StaticVerify(StaticForward):
    """``verify(cache, tokens) -> logits (len(tokens), vocab)``: the target's verify forward over a
    :class:`StaticKV`. Compiled, it is a fixed block of ``block`` tokens (a shorter round is padded: the padding's
    logits are dropped and its entries lie past ``length``), so it has one shape per cache capacity; eager, a round
    of fewer tokens runs on just those (a round that drafts less, or a plain target step, costs less).
    ``cache(prefilled, capacity)`` gives a :class:`StaticKV` in buffers this verify owns (one pair per capacity, at
    fixed addresses: what a CUDA graph replays over); ``on_device(cache, first, drafts)`` verifies a round whose
    drafts are still on the device."""

    def __init__(self, model, block: int, compile: bool = False):
        super().__init__(model, self._step, compile)
        self.block = block
        self.pad = compile  # every round padded to the block: one input shape per cache capacity (a graph's need)
        self.device = model.device
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.start = static_buffer((1,), torch.long, self.device)
        self.ids = static_buffer((block,), torch.long, self.device)

    def _step(self, start, ids, keys, values):
        n = ids.shape[0]
        pos = start + torch.arange(n, device=ids.device)
        mask = torch.arange(keys.shape[3], device=ids.device)[None] <= pos[:, None]
        return self._forward(ids[None], pos[None], pos, mask[None, None], keys, values)

    @torch.inference_mode()
    def cache(self, prefilled, capacity: int) -> StaticKV:
        """``prefilled`` (a transformers cache) copied into this verify's buffers of ``capacity`` tokens."""
        first = prefilled.layers[0].keys
        key = (len(prefilled.layers), *first.shape[:2], capacity, first.shape[-1], first.dtype)
        if key not in self._buffers:
            shape = key[:-1]
            self._buffers[key] = (static_buffer(shape, first.dtype, first.device, dynamic=3),
                                  static_buffer(shape, first.dtype, first.device, dynamic=3))
        return StaticKV(prefilled, capacity, self._buffers[key])

    def release(self) -> None:
        """Free the buffers of every capacity."""
        self._buffers.clear()

    def _ids(self, width: int) -> torch.Tensor:
        # The buffer itself when the block is whole: a view would be another tensor object, not the static one.
        return self.ids if width == self.block else self.ids[:width]

    def _width(self, n: int) -> int:
        if n > self.block:
            raise ValueError(f"a verify block holds {self.block} tokens, got {n}")
        return self.block if self.pad else n

    @torch.inference_mode()
    def __call__(self, cache: StaticKV, tokens: list[int]) -> torch.Tensor:
        width = self._width(len(tokens))
        host = torch.tensor([cache.length, *tokens], dtype=torch.long).to(self.device, non_blocking=True)
        self.start.copy_(host[:1])
        self.ids[:len(tokens)].copy_(host[1:])
        logits = self.fn(self.start, self._ids(width), cache.keys, cache.values)
        cache.length += len(tokens)
        return logits[:len(tokens)]

    @torch.inference_mode()
    def greedy(self, cache: StaticKV, first: int, n: int) -> torch.Tensor:
        """Plain greedy decoding of ``n`` tokens after ``first``, one step each, the tokens kept on the device (no host
        read: gpt-fast's loop): the tokens (n,)."""
        if self.block != 1:
            raise ValueError("greedy decoding steps one token: build the StaticVerify with block=1")
        out = torch.empty(n, dtype=torch.long, device=self.device)
        self.ids.fill_(first)
        self.start.fill_(cache.length)
        for i in range(n):
            logits = self.fn(self.start, self.ids, cache.keys, cache.values)
            self.ids.copy_(logits[-1].argmax()[None])
            out[i:i + 1].copy_(self.ids)
            self.start += 1
        cache.length += n
        return out

    @torch.inference_mode()
    def on_device(self, cache: StaticKV, first: int, drafts: torch.Tensor) -> torch.Tensor:
        """The logits at ``first`` then ``drafts`` (k,), a long tensor on the device: (1 + k, vocab)."""
        n = 1 + drafts.shape[0]
        width = self._width(n)
        self.ids[:1].fill_(first)  # a kernel argument, not a copy from host memory
        self.ids[1:n].copy_(drafts)
        self.start.fill_(cache.length)
        logits = self.fn(self.start, self._ids(width), cache.keys, cache.values)
        cache.length += n
        return logits[:n]
