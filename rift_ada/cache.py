"""RiftCache: the draft's compressed KV cache, a transformers ``Cache``.

Per layer the *active* cache is one physically compact tensor ``[importance | tail]``:
- importance: ``n_imp`` positions chosen per KV head by a scorer (heads may keep different positions);
- tail: the most recent tokens, contiguous and shared by all heads (the sliding window, plus the tokens of the
  round in flight).
A *backing store* keeps the full history (optionally on another device) so a refresh can bring back any position.

How it meets transformers 5.24's Cache contract (see shared/notes/BACKGROUND.md):
- ``get_seq_length()`` is the absolute token count ``L``; RoPE is applied before ``update``, so stored keys keep their
  rotation and callers always pass logical ``position_ids``.
- ``get_mask_sizes(q) = (n_active + q, L - n_active)``: every stored entry is visible to every new query, and new
  queries are causal among themselves. ``update`` returns exactly those ``n_active + q`` entries.
- ``crop(-n)`` trims the physical tail. Eviction is lazy: ``rollback(n)``, once per round, drops the round's n
  rejected tokens and only then evicts beyond the window, so a rollback never has to restore an evicted token.

One object owns the observation window: each layer keeps its recent post-RoPE queries, and ``observation()`` is the
only place that slices the last ``obs_window`` of them (scoring and query drift both read it).

Sliding-window layers (Gemma 3, GPT-OSS, Mistral / Qwen3 with a window) keep the model's own window semantics: a
:class:`SlidingLayer` holds the last ``window - 1`` tokens (plus the round in flight), exactly as the target's own
cache does, and the layout's budget applies to the full-attention layers (``RiftLayer``) only. A sliding layer's
attention never sees beyond its window, so compressing it would change nothing but its memory, which the window
already bounds.

Linear-attention / Mamba layers of hybrid models (Qwen3.5, Nemotron-H) keep their fixed-size conv and recurrent
states whole: a :class:`~rift_ada.recurrent.StateLayer` (transformers' ``LinearAttentionLayer`` plus checkpoints). A
recurrent state cannot be cropped, so a forward that may be rolled back is followed by ``checkpoint()``, and
``crop(-n)`` / ``rollback(n)`` restore the states checkpointed ``n`` tokens earlier. Cache-free blocks (MLP / MoE)
get transformers' ``DummyLayer``.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, DynamicSlidingWindowLayer

from .layout import CacheLayout
from .selection import gather_positions, observation_window, select_importance
from .recurrent import StateLayer


STORE_CHUNK = 1024  # tokens: the backing store's smallest growth step
ROUND_SLACK = 64  # active slots beyond the budget: a round's tokens in flight (k + 1 <= 64) never reallocate


def _fit(buf: torch.Tensor, filled: int, need: int, slack: int, dim: int = 2) -> torch.Tensor:
    """``buf`` if it holds ``need`` entries along ``dim`` (the token axis), else a larger one holding its first
    ``filled``: grown by ``slack`` past the need, and by at least a quarter (O(1) copying per appended token)."""
    cap = buf.shape[dim]
    if need <= cap:
        return buf
    shape = list(buf.shape)
    shape[dim] = max(need + slack, cap + cap // 4)
    # Zeros, not empty: the static step attends over unfilled slots too (masked), and 0 x NaN would be NaN.
    new = buf.new_zeros(shape)
    new.narrow(dim, 0, filled).copy_(buf.narrow(dim, 0, filled))
    return new


def _shift(buf: torch.Tensor, start: int, drop: int, end: int, dim: int = 2) -> None:
    """Close a gap in place: entries ``start + drop .. end`` move to ``start`` (a copy first: the ranges overlap)."""
    n = end - drop - start
    buf.narrow(dim, start, n).copy_(buf.narrow(dim, start + drop, n).clone())


class RiftLayer(CacheLayerMixin):
    """One full-attention layer of the draft: the active entries ``[importance | tail]`` and the backing store.

    Every tensor that changes per token lives in a preallocated buffer written in place, so a decode step allocates
    nothing and a static-shape step (``rift_ada.static``) can attend over the same buffers: the active keys / values
    (``_k`` / ``_v``, the first ``n_active`` slots filled, ``ROUND_SLACK`` spare), the observation queries (``_q``,
    ``_qpos``) and the backing store (``_store_k`` / ``_store_v``). ``keys`` / ``values`` / ``queries`` / ``query_pos``
    / ``store_k`` / ``store_v`` are views of their filled parts."""

    is_croppable = True
    is_sliding = False

    def __init__(self, keep_store: bool, store_device: str | torch.device | None, obs_window: int,
                 extra_queries: int = 64):
        super().__init__()
        self.keep_store = keep_store
        self.store_device = store_device
        self.obs_window = obs_window
        self.query_capacity = obs_window + extra_queries
        self.length = 0  # absolute tokens seen (logical length)
        self.n_imp = 0
        self.imp_pos: torch.Tensor | None = None  # (b, kv_heads, n_imp) absolute positions
        self._k = self._v = None
        self._n = 0
        # The backing store grows by at least a quarter (and STORE_CHUNK tokens past the need): a cat per token would
        # copy the whole history at every draft step, making the step's time grow with the context.
        self._store_k = self._store_v = None
        self.store_len = 0
        self._q = self._qpos = None  # (b, q_heads, cap, d) post-RoPE queries; (cap,) their positions
        self._nq = 0
        # The sliding window each query sees once the cache is compressed (None: every stored entry, as in a prefill
        # or a cache whose tail is never evicted): query i sees the importance part and tail positions [i - window, i].
        self.window: int | None = None
        self.queries: torch.Tensor | None = None
        self.query_pos: torch.Tensor | None = None

    # --- transformers Cache layer contract -------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, key_states.dtype
        self._k, self._v = key_states[:, :, :0].clone(), value_states[:, :, :0].clone()
        self._set_active(0)
        if self.keep_store:
            dev = self.store_device or self.device
            self._store_k, self._store_v = key_states[:, :, :0].to(dev).clone(), value_states[:, :, :0].to(dev).clone()
        self.imp_pos = torch.empty(*key_states.shape[:2], 0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self._n, key_states.shape[-2]
        self.reserve(n + q)
        self._k[:, :, n:n + q] = key_states
        self._v[:, :, n:n + q] = value_states
        self.commit(q)
        return self.keys, self.values

    def reserve(self, n: int) -> None:
        """Make room for ``n`` active entries (a no-op while decoding inside the budget)."""
        self._k = _fit(self._k, self._n, n, ROUND_SLACK)
        self._v = _fit(self._v, self._n, n, ROUND_SLACK)

    def commit(self, q: int) -> None:
        """The ``q`` entries after the active ones were just written (by ``update`` or a static step): count them
        active and append them to the backing store."""
        n = self._n
        if self.keep_store:
            self._store_append(self._k[:, :, n:n + q], self._v[:, :, n:n + q])
        self._set_active(n + q)
        self.length += q

    def _set_active(self, n: int) -> None:
        self._n = n
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    @property
    def capacity(self) -> int:
        """Active slots allocated (the static step attends over all of them, masking the unfilled ones)."""
        return 0 if self._k is None else self._k.shape[2]

    @property
    def store_k(self) -> torch.Tensor | None:
        """The backing store's keys, (b, kv_heads, length, d): a view of the filled part."""
        return None if self._store_k is None else self._store_k[:, :, :self.store_len]

    @property
    def store_v(self) -> torch.Tensor | None:
        return None if self._store_v is None else self._store_v[:, :, :self.store_len]

    def _store_append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        end = self.store_len + k.shape[-2]
        self._store_k = _fit(self._store_k, self.store_len, end, STORE_CHUNK)
        self._store_v = _fit(self._store_v, self.store_len, end, STORE_CHUNK)
        self._store_k[:, :, self.store_len:end] = k.to(self._store_k.device)
        self._store_v[:, :, self.store_len:end] = v.to(self._store_v.device)
        self.store_len = end

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called before update(): self.keys holds the n_active stored entries.
        stored = self.n_active
        return stored + query_length, self.length - stored

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("RiftLayer.crop takes a negative count of tokens to remove")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.n_tail:
            raise RuntimeError(f"cannot roll back {n} tokens: only {self.n_tail} recent tokens are in the tail "
                               "(compact() must run only after a round's rollback)")
        self._set_active(self._n - n)
        if self.keep_store:
            self.store_len -= n
        self.length -= n
        if self._nq:  # queries are recorded in position order: the dropped tokens' are the newest
            self._set_queries(self._nq - int((self.query_pos >= self.length).sum()))

    def reset(self) -> None:
        self.__init__(self.keep_store, self.store_device, self.obs_window, self.query_capacity - self.obs_window)

    # --- RIFT ------------------------------------------------------------------------------------------------------
    @property
    def n_active(self) -> int:
        return self._n

    @property
    def n_tail(self) -> int:
        return self._n - self.n_imp

    def active_positions(self) -> torch.Tensor:
        """(b, kv_heads, n_active) absolute positions of the active entries."""
        b, h = self.imp_pos.shape[:2]
        tail = torch.arange(self.length - self.n_tail, self.length, device=self.imp_pos.device)
        return torch.cat([self.imp_pos, tail.expand(b, h, -1)], dim=-1)

    def read_ahead(self, cap: int) -> tuple[float, float]:
        """(focus, runway) of this layer's sharpest read of the importance part by the newest query: the largest
        attention weight any query head puts on one importance entry, and how many of the positions right after that
        entry's (p + 1, p + 2, ...) its KV head still keeps (capped at ``cap``; a run reaching the window counts as
        ``cap``). See ``RiftCache.read_ahead``."""
        if self.queries is None or self.queries.shape[2] == 0 or self.n_imp == 0:
            return 0.0, 0.0
        q = self.queries[:, :, -1:].float()  # (b, hq, 1, d): the last token the draft was fed
        b, hq, _, d = q.shape
        hkv, n = self.keys.shape[1], self.n_imp
        a = (q.reshape(b, hkv, hq // hkv, d) @ self.keys.float().transpose(-1, -2) / d ** 0.5).softmax(-1)
        top, j = a[..., :n].max(-1)  # (b, hkv, g): each query head's strongest importance entry
        p = self.imp_pos
        brk = torch.ones_like(p, dtype=torch.bool)
        brk[..., :-1] = p[..., 1:] != p[..., :-1] + 1  # the last entry of each contiguous block
        idx = torch.arange(n, device=p.device)
        end = torch.where(brk, idx, n).flip(-1).cummin(-1).values.flip(-1)  # index of the block's last entry
        run = (end - idx).float()
        run = torch.where(p.gather(-1, end) + 1 >= self.length - self.n_tail, float(cap), run).clamp(max=cap)
        best = int(top.reshape(-1).argmax())
        runs = run.gather(-1, j.reshape(b, hkv, -1)).reshape(-1)
        return float(top.reshape(-1)[best]), float(runs[best])

    def observe(self, query: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        q = query.shape[2]
        if positions is None:  # called after update(): the queries are the newest tokens
            positions = torch.arange(self.length - q, self.length, device=query.device)
        pos = positions.reshape(-1)[-q:].to(query.device)
        if q >= self.query_capacity:  # a prefill: only the newest query_capacity can ever be read
            query, pos, q, self._nq = query[:, :, -self.query_capacity:], pos[-self.query_capacity:], \
                self.query_capacity, 0
        if self._q is None:
            self._q = query.new_empty(*query.shape[:2], self.query_capacity + ROUND_SLACK, query.shape[-1])
            self._qpos = pos.new_empty(self.query_capacity + ROUND_SLACK)
        # Trimmed in evict_tail(), after the round's rollback, so a rollback leaves no trace here either.
        n = self._nq
        self._q = _fit(self._q, n, n + q, ROUND_SLACK)
        self._qpos = _fit(self._qpos, n, self._q.shape[2], 0, dim=0)
        self._q[:, :, n:n + q] = query.detach()
        self._qpos[n:n + q] = pos
        self._set_queries(n + q)

    def _set_queries(self, n: int) -> None:
        self._nq = n
        self.queries, self.query_pos = self._q[:, :, :n], self._qpos[:n]

    def evict_tail(self, keep: int | None) -> None:
        """Drop the oldest tail entries so at most ``keep`` remain (they stay in the backing store), and the oldest
        observation queries beyond capacity. Runs after a round's rollback, never before."""
        extra = self._nq - self.query_capacity
        if extra > 0:
            _shift(self._q, 0, extra, self._nq)
            _shift(self._qpos, 0, extra, self._nq, dim=0)
            self._set_queries(self.query_capacity)
        drop = 0 if keep is None else self.n_tail - keep
        if drop > 0:
            for buf in (self._k, self._v):
                _shift(buf, self.n_imp, drop, self._n)
            self._set_active(self._n - drop)

    def observation(self, upto: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last ``obs_window`` recorded queries (b, q_heads, w, d) and their positions (w,), or (None, None);
        with ``upto``, the last of those at positions before it (a grid-aligned refresh)."""
        if upto is None or self.queries is None:
            return observation_window(self.queries, self.query_pos, self.obs_window)
        n = int((self.query_pos < upto).sum())  # recorded in position order
        return observation_window(self.queries[:, :, :n], self.query_pos[:n], self.obs_window)

    def window_mask(self, q: int) -> torch.Tensor | None:
        """(q, n_active) bool: which active entries each of the ``q`` newest queries may see (the importance part, and
        tail positions in [its position - window, its position]), after ``update`` stored them; None when that is
        every stored entry for every query (causality among the new queries aside). Mid-round the tail holds up to
        k tokens more than the window (eviction waits for the round's end, so a rollback never needs an evicted
        token); masking them makes what a query sees a function of its position alone, not of where its round
        began."""
        if self.window is None or self.n_tail <= self.window + 1:
            return None
        device = self._k.device
        pos_q = torch.arange(self.length - q, self.length, device=device)[:, None]
        pos_t = torch.arange(self.length - self.n_tail, self.length, device=device)[None]
        tail = (pos_t <= pos_q) & (pos_t >= pos_q - self.window)
        return torch.cat([tail.new_ones(q, self.n_imp), tail], dim=-1)

    def reselect(self, scorer, n_imp: int, tail_keep: int, history_k, history_v, capacity: int | None = None,
                 upto: int | None = None) -> None:
        """Rebuild ``[importance | tail]`` from the full history: the last ``tail_keep`` tokens form the tail; the
        best ``n_imp`` of the earlier positions (per KV head) form the importance part. ``capacity``: the active
        buffers' size from now on (a fixed budget's: the same at every refresh and context length, so a compiled
        step keeps its one graph); by default what the selection needs plus ``ROUND_SLACK``. ``upto``: score the
        history as it stood at that length (its observation queries, and candidates before its window: a
        grid-aligned refresh, ``CacheLayout.refresh_grid``); the tail kept is still the newest ``tail_keep``."""
        L = self.length
        # A history shorter than the budget: the importance part takes the oldest positions (the window policy's
        # sinks among them) rather than leaving them in the tail, from which they would later be evicted.
        tail_keep = min(tail_keep, max(L - n_imp, 0))
        t = L if upto is None else min(upto, L)
        candidates_end = min(t - min(tail_keep, max(t - n_imp, 0)), L - tail_keep)
        pos = select_importance(scorer, history_k, t, n_imp, t - candidates_end, *self.observation(t))
        imp_k = gather_positions(history_k, pos).to(self.device, self.dtype)
        imp_v = gather_positions(history_v, pos).to(self.device, self.dtype)
        # The tail may be a view of the active buffers themselves (compress() scores the prefilled entries): copied
        # out before the buffers are rewritten.
        tail_k = history_k[:, :, L - tail_keep:L].to(self.device, self.dtype, copy=True)
        tail_v = history_v[:, :, L - tail_keep:L].to(self.device, self.dtype, copy=True)
        n, m = imp_k.shape[2], imp_k.shape[2] + tail_keep
        want = max(capacity or 0, m + ROUND_SLACK)
        if self.capacity > 2 * want or (capacity and self.capacity != want):  # e.g. prompt-sized after a prefill
            self._k = self._k.new_zeros(*self._k.shape[:2], want, self._k.shape[-1])
            self._v = self._v.new_zeros(*self._v.shape[:2], want, self._v.shape[-1])
            self._n = 0
        self.reserve(m)
        for buf, imp, tail in ((self._k, imp_k, tail_k), (self._v, imp_v, tail_v)):
            buf[:, :, :n], buf[:, :, n:m] = imp, tail
        self._set_active(m)
        self.imp_pos, self.n_imp = pos.to(self.device), n

    def load(self, src) -> None:
        """Take the keys and values of a prefilled full-attention layer (which stores every token)."""
        if src.keys.shape[-2] != src.get_seq_length():
            raise RuntimeError("a RIFT layer can only load a layer that stores every token")
        self.update(src.keys.clone(), src.values.clone())


class SlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer of the draft: transformers' own ``DynamicSlidingWindowLayer`` (so ``get_mask_sizes``
    and ``update`` agree with the model's sliding mask by construction), always recording the past, so ``crop(-n)``
    rolls a round back exactly; ``crop(0)`` then trims it to its working size of ``window - 1`` tokens."""

    def __init__(self, sliding_window: int):
        super().__init__(sliding_window)
        self.activate_past_recording()

    @property
    def length(self) -> int:
        return self.cumulative_length

    @property
    def n_active(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        n = -tokens_to_remove
        # Past recording keeps every token fed since the last crop; a rollback deeper than that cannot be exact.
        if n > 0 and self.is_initialized and self.n_active - n < min(self.length - n, self.sliding_window - 1):
            raise RuntimeError(f"cannot roll back {n} tokens: this sliding layer holds only {self.n_active}")
        if self.is_initialized:
            super().crop(tokens_to_remove)

    def evict_tail(self, keep=None) -> None:
        """Back to the working size (``window - 1`` tokens) once a round is over; ``keep`` is the RIFT layers'."""
        self.crop(0)

    def load(self, src) -> None:
        """Take the keys and values of a prefilled sliding layer (any stored length covering the window)."""
        self.update(src.keys.clone(), src.values.clone())
        self.cumulative_length = src.get_seq_length()
        self.crop(0)


class RiftCache(Cache):
    """The draft's cache under a :class:`~rift_ada.layout.CacheLayout` (full, window, snapkv, rift).

    ``sliding_windows`` gives per layer None (a full-attention layer: a :class:`RiftLayer` under the layout) or the
    model's window in tokens (a :class:`SlidingLayer`); omitted, every layer is a RIFT layer. ``kinds``
    (``rift_ada.architectures.layer_kinds``) instead names every layer's kind, state and cache-free layers included;
    ``for_config`` reads them from a model's config. Only the RIFT layers are scored, refreshed and observed."""

    def __init__(self, num_layers: int, layout: CacheLayout, store_device: str | torch.device | None = None,
                 extra_queries: int = 64, sliding_windows: list[int | None] | None = None, kinds: list | None = None):
        from .architectures import LayerKind

        self.layout = layout
        self.scorer = layout.make_scorer()
        if kinds is None:
            windows = [None] * num_layers if sliding_windows is None else list(sliding_windows)
            kinds = [LayerKind("full") if w is None else LayerKind("sliding", w) for w in windows]
        if len(kinds) != num_layers:
            raise ValueError(f"{len(kinds)} layer kinds given for {num_layers} layers")
        make = {"full": lambda k: RiftLayer(layout.refreshable, store_device, layout.obs_window, extra_queries),
                "sliding": lambda k: SlidingLayer(k.window), "state": lambda k: StateLayer(k.states),
                "none": lambda k: DummyLayer()}
        layers = [make[k.kind](k) for k in kinds]
        super().__init__(layers=layers)
        self.rift_layers = [layer for layer in layers if isinstance(layer, RiftLayer)]
        self.kv_layers = [layer for layer in layers if isinstance(layer, (RiftLayer, SlidingLayer))]
        self.state_layers = [layer for layer in layers if isinstance(layer, StateLayer)]
        self._reference_queries: list[torch.Tensor] | None = None
        self.prompt_len: int | None = None  # the length compress() ran at: the origin of the refresh grid

    @classmethod
    def for_config(cls, config, layout: CacheLayout, store_device: str | torch.device | None = None,
                   extra_queries: int = 64) -> "RiftCache":
        """The cache for a model: one layer per decoder layer, of the model's own kind (UnsupportedModelError for
        layer types rift-ada does not handle)."""
        from .architectures import layer_kinds

        kinds = layer_kinds(config)
        return cls(len(kinds), layout, store_device, extra_queries, kinds=kinds)

    # Called by rift_ada.attention for each layer of a forward that passes rift_observer=self.
    def observe_queries(self, layer_idx: int, query: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        layer = self.layers[layer_idx]
        if isinstance(layer, RiftLayer):  # sliding layers are never scored: their queries are not needed
            layer.observe(query, positions)

    def window_mask(self, layer_idx: int, q: int) -> torch.Tensor | None:
        """``RiftLayer.window_mask`` of that layer (None for the other kinds: their own masks are exact)."""
        layer = self.layers[layer_idx]
        return layer.window_mask(q) if isinstance(layer, RiftLayer) else None

    def load_from(self, cache: Cache) -> None:
        """Take keys and values of a prefilled target cache (self-speculation: one prefill serves both models)."""
        for layer, src in zip(self.layers, cache.layers):
            if not isinstance(layer, DummyLayer):
                layer.load(src)

    @property
    def length(self) -> int:
        return self.kv_layers[0].length

    # --- the round protocol ---------------------------------------------------------------------------------------
    def compress(self) -> None:
        """After prefill: select from the prompt and keep the layout's tail (a no-op for ``full``); sliding layers
        shrink to their window."""
        lay = self.layout
        if lay.compress:
            for layer in self.rift_layers:
                layer.reselect(self.scorer, lay.n_imp, lay.tail_keep, layer.keys, layer.values, self._capacity())
                layer.window = lay.tail_limit
        self.prompt_len = self.length if self.kv_layers else None
        self._trim_sliding()
        self._remember_queries()

    def refresh(self) -> None:
        """Rescore the whole history (prompt + generated tokens that left the window) from the backing store with the
        most recent observation queries, and rebuild the importance part. The window is kept as it is."""
        if not self.layout.refreshable:
            raise RuntimeError(f"a {self.layout.describe()} cache without a backing store cannot refresh: use a "
                               "rift layout with store=True (policies rift-dyn / rift-ada)")
        upto = self.refresh_point()
        for layer in self.rift_layers:
            layer.reselect(self.scorer, self.layout.n_imp, layer.n_tail, layer.store_k, layer.store_v,
                           self._capacity(), upto)
        self._remember_queries(upto)

    def refresh_point(self) -> int:
        """The history length a refresh now scores: the current one, or the last point of the refresh grid
        (``CacheLayout.refresh_grid`` generated positions after the prompt)."""
        grid, length = self.layout.refresh_grid, self.length
        if grid == 1 or self.prompt_len is None:
            return length
        return self.prompt_len + (length - self.prompt_len) // grid * grid

    def _capacity(self) -> int | None:
        """Active slots per RIFT layer under a fixed budget: importance + window + one round in flight."""
        lay = self.layout
        return None if lay.tail_limit is None else lay.n_imp + lay.tail_limit + ROUND_SLACK

    def checkpoint(self) -> None:
        """Copy the linear-attention states after a forward that a rollback may return to (a no-op without such
        layers). The decoder calls it after each draft forward but the round's last."""
        for layer in self.state_layers:
            layer.checkpoint(self.length)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the ``-tokens_to_remove`` newest tokens: KV layers crop; linear-attention layers restore the states
        checkpointed that many tokens earlier."""
        if tokens_to_remove:
            for layer in self.state_layers:
                layer.restore(self.length + tokens_to_remove)
        for layer in self.kv_layers:
            layer.crop(tokens_to_remove)

    def rollback(self, rejected: int) -> None:
        """End a round: drop its ``rejected`` newest tokens (from every layer), then evict tail tokens beyond the
        sliding window. In this order, so a rollback never needs a token that eviction removed."""
        self.crop(-rejected)
        keep = self.layout.tail_limit
        for layer in self.rift_layers:
            layer.evict_tail(keep)
        self._trim_sliding()
        for layer in self.state_layers:
            layer.end_round()

    def _trim_sliding(self) -> None:
        for layer in self.layers:
            if isinstance(layer, SlidingLayer):
                layer.evict_tail()

    # --- signals and accounting -----------------------------------------------------------------------------------
    def _mean_queries(self, upto: int | None = None) -> list[torch.Tensor] | None:
        obs = [layer.observation(upto)[0] for layer in self.rift_layers]
        if not obs or any(q is None for q in obs):
            return None
        return [torch.nn.functional.normalize(q.float().mean(2), dim=-1) for q in obs]

    def _remember_queries(self, upto: int | None = None) -> None:
        self._reference_queries = self._mean_queries(upto)  # the queries the selection was scored with

    def query_drift(self) -> float:
        """1 - cosine between the mean recent observation query and the one used at the last scoring, averaged over
        RIFT layers and heads (0 = same queries; post-RoPE, so the fast-rotating dimensions mostly average out)."""
        now, ref = self._mean_queries(), self._reference_queries
        if now is None or ref is None:
            return 0.0
        # Layers of a model spread over GPUs (device_map) live on different devices: meet on the first one's.
        cos = torch.stack([(a * b).sum(-1).mean().to(now[0].device) for a, b in zip(now, ref)]).mean()
        return float(1.0 - cos)

    def read_ahead(self, cap: int = 64) -> tuple[float, float]:
        """(runway, focus) of the newest draft query, from the active cache alone (one small matmul per layer).

        focus: the largest attention weight any RIFT layer's query head puts on a single importance entry (a copying
        head reads ~1.0 there; diffuse heads much less); runway: how many tokens right after that entry the cache
        still holds (capped at ``cap``). While a model copies from far back, its copying head reads position p, then
        p + 1, ...: the runway counts down one per generated token and reaches 0 where the selection stops, before
        acceptance falls; once nothing reads the importance part sharply (a stale selection, or novel text) the
        focus drops. (0, 0) without importance entries."""
        best = (0.0, 0.0)
        for layer in self.rift_layers:
            best = max(best, layer.read_ahead(cap))
        return best[1], best[0]

    def active_bytes_by_kind(self) -> dict[str, int]:
        """Bytes the draft's layers hold now: keys and values attention reads, ``full`` (RIFT layers, under the
        budget) and ``sliding`` (the model's window layers, including the round in flight until the round's
        rollback trims them), and ``state``: the conv and recurrent states of linear-attention layers (fixed in
        input length; their rollback checkpoints are ``checkpoint_bytes()``)."""
        out = {"full": 0, "sliding": 0, "state": sum(layer.nbytes() for layer in self.state_layers)}
        for layer in self.kv_layers:
            if layer.is_initialized and layer.keys is not None:
                out["sliding" if isinstance(layer, SlidingLayer) else "full"] += layer.keys.nbytes + layer.values.nbytes
        return out

    def active_bytes(self) -> int:
        """Attention KV only (``full`` + ``sliding``)."""
        kinds = self.active_bytes_by_kind()
        return kinds["full"] + kinds["sliding"]

    def checkpoint_bytes(self) -> int:
        """Bytes of the linear-attention checkpoint slots (up to k - 1 copies of the states, reused every round)."""
        return sum(layer.checkpoint_bytes() for layer in self.state_layers)

    def active_tokens(self) -> int:
        """Active entries per head of the first RIFT layer (of the first KV layer if all attention layers slide)."""
        return (self.rift_layers or self.kv_layers)[0].n_active

    def clone(self) -> "RiftCache":
        """An independent copy."""
        return copy.deepcopy(self)
