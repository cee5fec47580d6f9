"""The target's cache for a batch: every row's keys and values in one buffer per layer, written in place.

A target's cache holds a row's whole history, so in a batch its reads are what a step costs: at 4K tokens the
testbed target keeps 305 MB per row against 314 MB of weights. transformers' ``DynamicCache`` concatenates its
tensors at every forward (a copy of the history per layer), and stacking separate rows for a batched forward would
copy it once more. ``TargetStore`` instead allocates, per attention layer, one (rows, kv_heads, capacity, d) buffer
once per batch; row i's entries fill its own slots from 0 up to its own length, a forward writes each row's new
entries at that row's own offset, a rollback just lowers the row's count (as vLLM rolls back by decrementing a
request's computed tokens), and a batched forward attends over a view of the buffer (``RowBatch`` takes it without
a copy while the forward's rows are the store's rows in order). A row that ends is dropped from the store by
:meth:`TargetStore.keep` (one copy of the live rows when a row leaves, not one per step).

Each row's view is a :class:`RowCache`, a transformers ``Cache`` whose attention layers are :class:`RowLayer`:
for one row alone (a hybrid target's replay after a rejection) it is an ordinary cache with the model's own masks;
recurrent layers stay the row's own ``LinearAttentionLayer`` from its prefill.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, LinearAttentionCacheLayerMixin


class TargetStore:
    """Per attention layer, the keys and values of every row of a batch: (rows, kv_heads, capacity, d) buffers."""

    def __init__(self, rows: int, capacity: int):
        self.rows, self.capacity = rows, capacity
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.views: list[RowCache] = []

    def buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.k:
            shape = (self.rows, like.shape[1], self.capacity, like.shape[-1])
            self.k[layer_idx] = like.new_zeros(shape)
            self.v[layer_idx] = like.new_zeros(shape)
        return self.k[layer_idx], self.v[layer_idx]

    def adopt(self, row: int, cache: Cache) -> "RowCache":
        """Row ``row``'s view, holding what the prefilled ``cache`` holds (its attention layers' entries copied into
        the buffers, its recurrent layers taken as they are)."""
        layers = []
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin) or not isinstance(layer, CacheLayerMixin):
                layers.append(layer)
                continue
            mine = RowLayer(self, i, row, getattr(layer, "sliding_window", None))
            mine.load(layer)
            layers.append(mine)
        view = RowCache(layers=layers)
        self.views.append(view)
        return view

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (store indices, in the order they keep), renumbering their views: one copy of them."""
        if rows == list(range(self.rows)):
            return
        index = torch.tensor(rows, device=next(iter(self.k.values())).device) if self.k else None
        for i in list(self.k):
            self.k[i], self.v[i] = self.k[i].index_select(0, index), self.v[i].index_select(0, index)
        self.views = [self.views[r] for r in rows]
        for new, view in enumerate(self.views):
            for layer in view.layers:
                if isinstance(layer, RowLayer):
                    layer.row = new
        self.rows = len(rows)


class RowLayer(DynamicLayer):
    """One attention layer of one row in a :class:`TargetStore`: the row's ``stored`` entries (the positions
    ``length - stored`` to ``length - 1``; a sliding layer's prefill may have kept only its window) fill its slots
    from 0. ``get_mask_sizes`` reports them as transformers' sliding layer does (``kv_offset`` = positions not
    stored), so the model's own masks are exact for a forward of this row alone."""

    is_croppable = True

    def __init__(self, store: TargetStore, layer_idx: int, row: int, sliding_window: int | None = None):
        super().__init__()
        self.store, self.layer_idx, self.row = store, layer_idx, row
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.stored = 0
        self.length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.store.buffers(self.layer_idx, key_states)
        self.device = key_states.device
        self.is_initialized = True

    def load(self, src) -> None:
        if getattr(src, "keys", None) is None or src.keys.numel() == 0:
            return
        self.lazy_initialization(src.keys, src.values)
        n = src.keys.shape[-2]
        if n > self.store.capacity:
            raise RuntimeError(f"a prefilled row of {n} tokens exceeds the store's capacity {self.store.capacity}")
        k, v = self.store.k[self.layer_idx], self.store.v[self.layer_idx]
        k[self.row, :, :n], v[self.row, :, :n] = src.keys[0], src.values[0]
        self.stored, self.length = n, src.get_seq_length()

    @property
    def keys(self):
        k = self.store.k.get(self.layer_idx)
        return None if k is None else k[self.row:self.row + 1, :, :self.stored]

    @keys.setter
    def keys(self, value):  # set to None by the base class's __init__ only
        if value is not None:
            raise AttributeError("a RowLayer's keys live in its TargetStore")

    @property
    def values(self):
        v = self.store.v.get(self.layer_idx)
        return None if v is None else v[self.row:self.row + 1, :, :self.stored]

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("a RowLayer's values live in its TargetStore")

    def write(self, key_states, value_states) -> None:
        """Append this row's ``q`` new entries ((kv_heads, q, d)) at its own offset."""
        if not self.is_initialized:
            self.lazy_initialization(key_states[None], value_states[None])
        q = key_states.shape[-2]
        if self.stored + q > self.store.capacity:
            raise RuntimeError(f"row {self.row} would hold {self.stored + q} tokens, beyond the store's capacity "
                               f"{self.store.capacity}")
        self.store.k[self.layer_idx][self.row, :, self.stored:self.stored + q] = key_states
        self.store.v[self.layer_idx][self.row, :, self.stored:self.stored + q] = value_states
        self.stored += q
        self.length += q

    def update(self, key_states, value_states, *args, **kwargs):
        self.write(key_states[0], value_states[0])
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored + query_length, self.length - self.stored

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("RowLayer.crop takes a negative count of tokens to remove")
        n = -tokens_to_remove
        if n > self.stored:
            raise RuntimeError(f"cannot roll back {n} tokens: row {self.row} stores {self.stored}")
        self.stored -= n
        self.length -= n


class RowCache(Cache):
    """One row's target cache over a :class:`TargetStore` (and its own recurrent layers): a transformers ``Cache``
    of the layers :meth:`TargetStore.adopt` gives it."""
