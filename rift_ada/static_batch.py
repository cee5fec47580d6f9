"""Static-shape steps for a batch: the draft's step over every row's RIFT buffers, the target's verify over a block
per row, shapes fixed by (rows, capacity) and (rows, k + 1).

``rift_ada.static`` runs one sequence; here the same tensor code runs a batch, each row with its own counters:
``BatchDraftStep`` owns one arena for all rows (keys and values (layers, rows, kv_heads, capacity, d), the
observation log's queries and positions), each row's ``RiftLayer`` adopting its row's views, so a row's refresh
rewrites its own slots in place and the graph never changes. A step feeds every row one token at that row's own
position, writes its key, value and query at that row's own slot (a scatter by row), attends under that row's own
mask (its importance part, and its tail inside the window) and draws that row's next draft; a row whose round is
shorter (one pending token instead of two, or fewer drafts near its end) idles through the extra steps: its writes
land in its next free slot, which its next real step overwrites, and its counters stay. ``BatchVerify`` verifies a
block of k + 1 tokens per row over ``BatchStaticKV``, one (layers, rows, kv_heads, capacity, d) buffer pair with a
length per row (a row's view, ``RowStaticKV``, is what that row's rollback crops).

Rows that end stay in the batch as idle rows (their steps are computed and dropped), so one graph, compiled or
captured, serves the whole batched generation, refreshes included; the model steps (``rift_ada.batch``) drop them
instead. Supported: what ``rift_ada.static`` supports (Llama-family models whose every layer is full attention).
"""

from __future__ import annotations

import torch

from .rounds import entropy, sampling_probs
from .static import MAX_ROUND, NO_WINDOW, StaticForward, check_static, static_buffer


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``rounds.draw`` for each row: the token (rows,) that row i's uniform ``u[i]`` picks from ``probs[i]`` by the
    inverse CDF (the first token whose cumulative mass exceeds it; the last token with any mass if rounding puts it
    beyond)."""
    cdf = probs.double().cumsum(-1)
    i = torch.searchsorted(cdf, u.reshape(-1, 1).to(cdf.dtype), right=True)[:, 0]
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, vocab, -1).max(-1).values
    return torch.where(i < probs.shape[-1], i, last)


# --- the draft ----------------------------------------------------------------------------------------------------------
class BatchDraftArena:
    """Every row's draft buffers at one capacity: keys and values (layers, rows, kv_heads, capacity, d), queries
    (layers, rows, heads, log slots, d), their positions (layers, rows, log slots). Row r's RIFT layer l adopts
    ``[l, r:r + 1]`` of each (``RiftLayer.adopt``)."""

    def __init__(self, caches, capacity: int):
        first = caches[0].rift_layers
        k, q = first[0].buffers[0], first[0].log.buffer
        n, rows = len(first), len(caches)
        log = first[0].log
        self.capacity = capacity
        self.k = static_buffer((n, rows, k.shape[1], capacity, k.shape[-1]), k.dtype, k.device)
        self.v = static_buffer(self.k.shape, k.dtype, k.device)
        self.q = static_buffer((n, rows, q.shape[1], log.capacity + MAX_ROUND, q.shape[-1]), q.dtype, q.device)
        self.qpos = static_buffer((n, rows, self.q.shape[3]), torch.long, q.device)

    def adopt(self, caches) -> None:
        for r, cache in enumerate(caches):
            for i, layer in enumerate(cache.rift_layers):
                layer.adopt(self.k[i, r:r + 1], self.v[i, r:r + 1], self.q[i, r:r + 1], self.qpos[i, r])

    def holds(self, caches) -> bool:
        return all(layer.buffers[0].data_ptr() == self.k[i, r:r + 1].data_ptr()
                   and layer.log.buffer.data_ptr() == self.q[i, r:r + 1].data_ptr()
                   for r, cache in enumerate(caches) for i, layer in enumerate(cache.rift_layers))


class BatchDraftStep(StaticForward):
    """The draft's static step for a batch of RIFT caches. ``prepare(caches, capacity)`` after the rows' prefills;
    ``round(caches, pendings, ks, generators)`` drafts each row's ``ks[r]`` tokens on the device (no host read):
    (drafts (rows, max k) long, their distributions (rows, max k, vocab) or None when greedy, entropies (rows, max
    k)); row r's values past its ``ks[r]`` mean nothing."""

    COUNTERS = 8  # position, slot, log slot, step, first drafting step, n_imp, steps this round, window

    def __init__(self, model, rows: int, compile: bool = False, sampling=(0.0, 0, 1.0)):
        check_static(model)
        super().__init__(model, self._step, compile)
        self.temperature, self.top_k, self.top_p = sampling
        self.rows, self.device = rows, model.device
        self.arena: BatchDraftArena | None = None
        self.state = static_buffer((rows, self.COUNTERS), torch.long, self.device)
        self.tokens = static_buffer((rows, MAX_ROUND + 2), torch.long, self.device)
        self.uniforms = static_buffer((rows, MAX_ROUND + 1), torch.float64, self.device)
        self.entropies = static_buffer((rows, MAX_ROUND), torch.float32, self.device)
        vocab = model.config.vocab_size
        self.q_probs = static_buffer((rows, MAX_ROUND, vocab) if self.temperature else (1, 1, 1), torch.float32,
                                     self.device)

    def _step(self, state, tokens, uniforms, entropies, q_probs, keys, values, qlog, qpos):
        s = state.clone()
        pos, slot, qslot, j, first, n_imp, steps, window = s.unbind(1)
        live = j < steps
        slots = torch.arange(keys.shape[3], device=keys.device)[None]
        band = slots >= slot[:, None] - window[:, None]
        mask = (slots <= slot[:, None]) & ((slots < n_imp[:, None]) | band)
        ids = tokens.gather(1, j.clamp_max(tokens.shape[1] - 1)[:, None])
        logits = self._layers(ids, pos[:, None], slot[:, None], mask[:, None, None], keys, values, qlog,
                                    qpos, qslot[:, None])[:, -1]
        keep = live & (j >= first)
        d = (j - first).clamp(0, entropies.shape[1] - 1)
        if self.temperature == 0:
            token = logits.argmax(-1)
        else:
            probs = sampling_probs(logits, self.temperature, self.top_k, self.top_p)
            token = draw_rows(probs, uniforms.gather(1, d[:, None]))
            at = d[:, None, None].expand(-1, 1, probs.shape[-1])
            q_probs.scatter_(1, at, torch.where(keep[:, None, None], probs[:, None], q_probs.gather(1, at)))
        ent = entropy(logits)
        entropies.scatter_(1, d[:, None], torch.where(keep, ent, entropies.gather(1, d[:, None])[:, 0])[:, None])
        nxt = (j + 1).clamp_max(tokens.shape[1] - 1)[:, None]
        tokens.scatter_(1, nxt, torch.where(keep, token, tokens.gather(1, nxt)[:, 0])[:, None])
        state[:, :4] += live[:, None].long()
        return logits

    @torch.inference_mode()
    def prepare(self, caches, capacity: int | None = None) -> None:
        """Move every row's RIFT layers into one arena: of the budget's capacity under a RIFT budget (every row
        the same), of ``capacity`` for caches that grow (full, snapkv)."""
        for cache in caches:
            for layer in cache.rift_layers:
                layer.log.trim()
        # Under a budget every row's buffers have the budget's capacity (RiftCache._capacity): the arena keeps it,
        # so a refresh (RiftLayer.reselect) rewrites the row's slots in place instead of reallocating.
        cap = max(c.rift_layers[0].capacity if capacity is None or c.layout.tail_limit is not None else capacity
                  for c in caches)
        self.arena = BatchDraftArena(caches, cap)
        self.arena.adopt(caches)

    @torch.inference_mode()
    def round(self, caches, pendings: list[list[int]], ks: list[int], generators=None):
        steps = [len(p) + k - 1 if k else 0 for p, k in zip(pendings, ks)]
        if max(ks) > MAX_ROUND or max(len(p) for p in pendings) > 2:
            raise ValueError(f"a static round drafts at most {MAX_ROUND} tokens after 1 or 2 pending ones")
        if self.arena is None or not self.arena.holds(caches):
            self.prepare(caches)
        start = []
        for cache, pending, k, n in zip(caches, pendings, ks, steps):
            first = cache.rift_layers[0]
            if first.n_active + n + 1 > self.arena.capacity:
                raise RuntimeError(f"a row holds {first.n_active} of {self.arena.capacity} slots: no room for a round")
            window = NO_WINDOW if first.window is None else first.window
            start.append([first.length, first.n_active, first.log.size, 0, max(len(pending) - 1, 0), first.n_imp, n,
                          window] + (pending + [0, 0])[:2])
        host = torch.tensor(start, dtype=torch.long)
        dev = host.to(self.device, non_blocking=True)
        self.state.copy_(dev[:, :self.COUNTERS])
        self.tokens[:, :2].copy_(dev[:, self.COUNTERS:])
        if self.temperature:
            for r, k in enumerate(ks):  # each row's own generator: the draws a single decoder would take
                if k:
                    self.uniforms[r, :k].copy_(torch.rand(k, generator=generators[r], device=self.device,
                                                          dtype=torch.float64))
        args = (self.state, self.tokens, self.uniforms, self.entropies, self.q_probs, self.arena.k, self.arena.v,
                self.arena.q, self.arena.qpos)
        for _ in range(max(steps)):
            self.fn(*args)
        for cache, n in zip(caches, steps):
            for layer in cache.rift_layers:
                layer.advance(n)
        # Row r's drafts sit at tokens[r, len(pending):]: the rows with one pending token shifted left by one.
        k = max(ks)
        idx = torch.tensor([[len(p) + i for i in range(k)] for p in pendings], device=self.device)
        drafts = self.tokens.gather(1, idx.clamp_max(self.tokens.shape[1] - 1))
        return drafts, (self.q_probs[:, :k] if self.temperature else None), self.entropies[:, :k]


# --- the target ---------------------------------------------------------------------------------------------------------
class BatchStaticKV:
    """The target's cache for every row in fixed buffers: ``keys`` / ``values`` (layers, rows, kv_heads, capacity,
    d), slot = position, and a length per row (``lengths``, host ints); ``load(r, cache)`` copies row r's prefilled
    cache in (the buffers allocated at the first: a row's prefill is dropped as soon as it is copied); ``view(r)`` is
    row r's ``RowStaticKV``."""

    def __init__(self, rows: int, capacity: int):
        self.rows, self.capacity = rows, capacity
        self.keys = self.values = None
        self.lengths = [0] * rows

    def load(self, row: int, cache) -> "RowStaticKV":
        first = cache.layers[0].keys
        if self.keys is None:
            shape = (len(cache.layers), self.rows, first.shape[1], self.capacity, first.shape[-1])
            self.keys = static_buffer(shape, first.dtype, first.device)
            self.values = static_buffer(shape, first.dtype, first.device)
        n = cache.get_seq_length()
        for i, layer in enumerate(cache.layers):
            self.keys[i, row, :, :n] = layer.keys[0]
            self.values[i, row, :, :n] = layer.values[0]
        self.lengths[row] = n
        return RowStaticKV(self, row)


class RowStaticKV:
    """Row ``row`` of a :class:`BatchStaticKV`: its length, and ``crop(-n)`` moving it back (entries past it are
    invisible under the causal mask and rewritten before a query sees them)."""

    layers: list = []  # no linear-attention states (rift_ada.recurrent.TargetStates finds none)

    def __init__(self, store: BatchStaticKV, row: int):
        self.store, self.row = store, row

    def get_seq_length(self) -> int:
        return self.store.lengths[self.row]

    def crop(self, tokens_to_remove: int) -> None:
        self.store.lengths[self.row] += min(tokens_to_remove, 0)


class BatchVerify(StaticForward):
    """The target's verify of a block of ``block`` tokens per row over a :class:`BatchStaticKV`: row r's pending
    token and drafts at its own positions; a row with fewer drafts is padded (the padding's entries lie past its
    length, its logits are dropped), so the shape is (rows, block) every round."""

    def __init__(self, model, rows: int, block: int, compile: bool = False):
        check_static(model, role="target")
        super().__init__(model, self._step, compile)
        self.rows, self.block, self.device = rows, block, model.device
        self.start = static_buffer((rows,), torch.long, self.device)
        self.ids = static_buffer((rows, block), torch.long, self.device)

    def _step(self, start, ids, keys, values):
        pos = start[:, None] + torch.arange(ids.shape[1], device=ids.device)[None]
        mask = torch.arange(keys.shape[3], device=ids.device)[None, None] <= pos[:, :, None]
        return self._layers(ids, pos, pos, mask[:, None], keys, values)

    @torch.inference_mode()
    def on_device(self, kv: BatchStaticKV, firsts: list[int], drafts: torch.Tensor, ks: list[int]) -> torch.Tensor:
        """The logits (rows, block, vocab) at each row's ``firsts[r]`` then its ``ks[r]`` drafts (``drafts`` (rows,
        max k) on the device); each row's length grows by 1 + ks[r] (an ended row, ``ks[r] = -1``, stays)."""
        k = drafts.shape[1]
        if k + 1 > self.block:
            raise ValueError(f"a verify block holds {self.block} tokens, got {k + 1}")
        host = torch.tensor([[length, first] for length, first in zip(kv.lengths, firsts)], dtype=torch.long)
        dev = host.to(self.device, non_blocking=True)
        self.start.copy_(dev[:, 0])
        self.ids[:, 0].copy_(dev[:, 1])
        self.ids[:, 1:k + 1].copy_(drafts)
        logits = self.fn(self.start, self.ids, kv.keys, kv.values)
        for r, kr in enumerate(ks):
            kv.lengths[r] += 1 + kr if kr >= 0 else 0
        return logits
