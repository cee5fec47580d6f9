"""RiftLayer: one full-attention layer of the draft's compressed cache (``rift_ada.cache.RiftCache``).

Its active entries are one physically compact tensor ``[importance | tail]``: ``n_imp`` positions chosen per KV head
by a scorer, then the most recent tokens, contiguous and shared by all heads (the sliding window, plus the round in
flight). A backing store keeps the full history (optionally on another device) so a refresh can bring back any
position, and a :class:`QueryLog` keeps the recent observation queries that scoring and query drift read. Every
per-token tensor lives in a preallocated buffer written in place (``_fit`` grows one, ``_shift`` closes a gap).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .selection import gather_positions, observation_window, select_importance

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


class QueryLog:
    """A RIFT layer's recent post-RoPE queries and their positions, in position order, in preallocated buffers
    (``ROUND_SLACK`` spare). ``observation()`` is the one place that slices the last ``obs_window`` of them (scoring
    and query drift both read it). Holds up to ``capacity`` between rounds: the round's queries are trimmed in
    ``trim()``, after the round's rollback, so a rollback leaves no trace here either.

    ``end``: one past the newest recorded position, when the host knows it and the recorded positions are
    consecutive (a decoder feeds them so): a rollback and a grid-aligned observation then count what to drop on the
    host instead of reading the positions back from the device (None: they read them)."""

    def __init__(self, obs_window: int, extra: int = 64):
        self.obs_window = obs_window
        self.capacity = obs_window + extra
        self._q = self._qpos = None  # (b, q_heads, cap, d) post-RoPE queries; (cap,) their positions
        self._n = 0
        self.end: int | None = None
        self.queries: torch.Tensor | None = None
        self.query_pos: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Queries recorded (the next one goes to this slot)."""
        return self._n

    def record(self, query: torch.Tensor, pos: torch.Tensor, end: int | None = None) -> None:
        """Append ``query`` (b, q_heads, q, d) at positions ``pos`` (q,); ``end``: one past the last of them, if the
        caller knows the log then holds consecutive positions."""
        q = query.shape[2]
        if q >= self.capacity:  # a prefill: only the newest capacity can ever be read
            query, pos, q, self._n = query[:, :, -self.capacity:], pos[-self.capacity:], self.capacity, 0
        if self._q is None:
            self._q = query.new_empty(*query.shape[:2], self.capacity + ROUND_SLACK, query.shape[-1])
            self._qpos = pos.new_empty(self.capacity + ROUND_SLACK)
        n = self._n
        self._q = _fit(self._q, n, n + q, ROUND_SLACK)
        self._qpos = _fit(self._qpos, n, self._q.shape[2], 0, dim=0)
        self._q[:, :, n:n + q] = query.detach()
        self._qpos[n:n + q] = pos
        self._set(n + q)
        self.end = end

    def adopt(self, q: torch.Tensor, qpos: torch.Tensor, end: int) -> None:
        """Move into ``q`` / ``qpos`` (buffers of the same slots a static step writes), the queries recorded so far
        being consecutive positions ending before ``end``."""
        n = self._n
        q[:, :, :n] = self._q[:, :, :n]
        qpos[:n] = self._qpos[:n]
        self._q, self._qpos = q, qpos
        self._set(n)
        self.end = end

    @property
    def buffer(self) -> torch.Tensor | None:
        """The whole query buffer (b, q_heads, slots, d), filled up to ``size``: what a static step writes into."""
        return self._q

    def advance(self, m: int) -> None:
        """A static step wrote the next ``m`` queries and positions into the buffers: count them."""
        self._set(self._n + m)
        if self.end is not None:
            self.end += m

    def _set(self, n: int) -> None:
        self._n = n
        self.queries, self.query_pos = self._q[:, :, :n], self._qpos[:n]

    def drop_from(self, length: int) -> None:
        """Forget the queries at positions >= ``length`` (a rollback): recorded in position order, they are the
        newest."""
        if self._n:
            if self.end is None:
                self._set(self._n - int((self.query_pos >= length).sum()))
            else:
                self._set(self._n - min(max(self.end - length, 0), self._n))
                self.end = min(self.end, length)

    def trim(self) -> None:
        """Forget the oldest queries beyond ``capacity`` (at a round's end)."""
        extra = self._n - self.capacity
        if extra > 0:
            _shift(self._q, 0, extra, self._n)
            _shift(self._qpos, 0, extra, self._n, dim=0)
            self._set(self.capacity)

    def observation(self, upto: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last ``obs_window`` recorded queries (b, q_heads, w, d) and their positions (w,), or (None, None);
        with ``upto``, the last of those at positions before it (a grid-aligned refresh)."""
        if upto is None or self.queries is None:
            return observation_window(self.queries, self.query_pos, self.obs_window)
        if self.end is None:
            n = int((self.query_pos < upto).sum())  # recorded in position order
        else:
            n = self._n - min(max(self.end - upto, 0), self._n)
        return observation_window(self.queries[:, :, :n], self.query_pos[:n], self.obs_window)


class RiftLayer(CacheLayerMixin):
    """One full-attention layer of the draft: the active entries ``[importance | tail]`` and the backing store.

    Every tensor that changes per token lives in a preallocated buffer written in place, so a decode step allocates
    nothing and a static-shape step (``rift_ada.static``) can attend over the same buffers: the active keys / values
    (``_k`` / ``_v``, the first ``n_active`` slots filled, ``ROUND_SLACK`` spare), the observation queries (a
    :class:`QueryLog`) and the backing store (``_store_k`` / ``_store_v``). ``keys`` / ``values`` / ``queries`` /
    ``query_pos`` / ``store_k`` / ``store_v`` are views of their filled parts."""

    is_croppable = True
    is_sliding = False

    def __init__(self, keep_store: bool, store_device: str | torch.device | None, obs_window: int,
                 extra_queries: int = 64):
        super().__init__()
        self.keep_store = keep_store
        self.store_device = store_device
        self.log = QueryLog(obs_window, extra_queries)
        self.length = 0  # absolute tokens seen (logical length)
        self.n_imp = 0
        self.imp_pos: torch.Tensor | None = None  # (b, kv_heads, n_imp) absolute positions
        self._k = self._v = None
        self._n = 0
        # The backing store grows by at least a quarter (and STORE_CHUNK tokens past the need): a cat per token would
        # copy the whole history at every draft step, making the step's time grow with the context.
        self._store_k = self._store_v = None
        self.store_len = 0
        # The sliding window each query sees once the cache is compressed (None: every stored entry, as in a prefill
        # or a cache whose tail is never evicted): query i sees the importance part and tail positions [i - window, i].
        self.window: int | None = None

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
        """The ``q`` entries after the active ones were just written (by ``update``): count them active and append
        them to the backing store."""
        n = self._n
        if self.keep_store:
            self.flush_store()
            self._store_append(self._k[:, :, n:n + q], self._v[:, :, n:n + q])
        self._set_active(n + q)
        self.length += q

    def advance(self, q: int) -> None:
        """A static step (``rift_ada.static``) wrote the next ``q`` entries and their queries into the buffers: count
        them. Their copy into the backing store waits for ``flush_store`` (at the round's end, or when the store is
        read), one copy per round instead of one per token."""
        self._set_active(self._n + q)
        self.length += q
        self.log.advance(q)

    def flush_store(self) -> None:
        """Append to the backing store the newest entries not yet in it (the last active slots: eviction flushes
        first, so they are still there)."""
        pending = self.length - self.store_len if self.keep_store and self._store_k is not None else 0
        if pending > 0:
            n = self._n
            with torch.inference_mode():  # a reader of the store outside it (a test) still gets it whole
                self._store_append(self._k[:, :, n - pending:n], self._v[:, :, n - pending:n])

    def adopt(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, qpos: torch.Tensor) -> None:
        """Move the active entries into ``k`` / ``v`` and the observation log into ``q`` / ``qpos``: buffers a static
        step owns at fixed addresses (``rift_ada.static.DraftArena``), of this layer's shapes."""
        n = self._n
        k[:, :, :n], v[:, :, :n] = self._k[:, :, :n], self._v[:, :, :n]
        self._k, self._v = k, v
        self._set_active(n)
        self.log.adopt(q, qpos, self.length)

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The active keys' and values' whole buffers (b, kv_heads, capacity, d), filled up to ``n_active``: what a
        static step (``rift_ada.static``) attends over and writes into, and the shapes its arena copies."""
        return self._k, self._v

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
        self.flush_store()
        return None if self._store_k is None else self._store_k[:, :, :self.store_len]

    @property
    def store_v(self) -> torch.Tensor | None:
        self.flush_store()
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
                               "(evict_tail() must run only after a round's rollback)")
        self._set_active(self._n - n)
        if self.keep_store:
            self.store_len = min(self.store_len, self.length - n)
        self.length -= n
        self.log.drop_from(self.length)

    def reset(self) -> None:
        self.__init__(self.keep_store, self.store_device, self.log.obs_window, self.log.capacity - self.log.obs_window)

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

    def read_ahead(self, cap: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(focus, runway) of this layer's sharpest read of the importance part by the newest query, as 0-d tensors
        on the device (no host read): the largest attention weight any query head puts on one importance entry, and
        how many of the positions right after that entry's (p + 1, p + 2, ...) its KV head still keeps (capped at
        ``cap``; a run reaching the window counts as ``cap``); None without queries or importance entries. See
        ``RiftCache.read_ahead``."""
        if self.queries is None or self.queries.shape[2] == 0 or self.n_imp == 0:
            return None
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
        best = top.reshape(-1).argmax()
        runs = run.gather(-1, j.reshape(b, hkv, -1)).reshape(-1)
        return top.reshape(-1)[best], runs[best]

    def observe(self, query: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Record the post-RoPE ``query`` (b, q_heads, q, d) of the newest tokens, or of ``positions``."""
        q = query.shape[2]
        if positions is None:  # called after update(): the queries are the newest tokens
            positions = torch.arange(self.length - q, self.length, device=query.device)
        self.log.record(query, positions.reshape(-1)[-q:].to(query.device))

    @property
    def queries(self) -> torch.Tensor | None:
        """The recorded observation queries (b, q_heads, n, d), oldest first (``QueryLog``)."""
        return self.log.queries

    @queries.setter
    def queries(self, value: torch.Tensor | None) -> None:  # what read_ahead sees (a test sets it directly)
        self.log.queries = value

    @property
    def query_pos(self) -> torch.Tensor | None:
        return self.log.query_pos

    @property
    def obs_window(self) -> int:
        return self.log.obs_window

    def evict_tail(self, keep: int | None) -> None:
        """Drop the oldest tail entries so at most ``keep`` remain (they stay in the backing store), and the oldest
        observation queries beyond capacity. Runs after a round's rollback, never before."""
        self.flush_store()
        self.log.trim()
        drop = 0 if keep is None else self.n_tail - keep
        if drop > 0:
            for buf in (self._k, self._v):
                _shift(buf, self.n_imp, drop, self._n)
            self._set_active(self._n - drop)

    def observation(self, upto: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``QueryLog.observation``: the queries scoring and query drift read."""
        return self.log.observation(upto)

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
