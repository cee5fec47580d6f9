"""RiftCache: the draft's compressed KV cache, a transformers ``Cache``.

Per full-attention layer (a ``RiftLayer``, ``rift_ada.rift_layer``) the *active* cache is one physically compact
tensor ``[importance | tail]``:
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

One object owns the observation window: each layer keeps its recent post-RoPE queries in a ``QueryLog``, whose
``observation()`` is the only place that slices the last ``obs_window`` of them (scoring and query drift both read
it).

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
from transformers.cache_utils import Cache, DummyLayer, DynamicSlidingWindowLayer

from .layout import CacheLayout
from .recurrent import StateLayer
from .rift_layer import ROUND_SLACK, RiftLayer

__all__ = ["RiftCache", "RiftLayer", "SlidingLayer"]


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
                   extra_queries: int = 64, kinds=None) -> "RiftCache":
        """The cache for a model: one layer per decoder layer, of the model's own kind (UnsupportedModelError for
        layer types rift-ada does not handle). ``kinds``: the model's ``layer_kinds``, when its owner computed them
        already (a decoder does once, and carries them to every cache it builds)."""
        from .architectures import layer_kinds

        kinds = layer_kinds(config) if kinds is None else kinds
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
        return float(self.query_drift_tensor())

    def query_drift_tensor(self) -> torch.Tensor:
        """``query_drift`` as a 0-d float tensor on the device, nothing read back to the host."""
        now, ref = self._mean_queries(), self._reference_queries
        if now is None or ref is None:
            return torch.zeros((), device=self._device())
        # Layers of a model spread over GPUs (device_map) live on different devices: meet on the first one's.
        cos = torch.stack([(a * b).sum(-1).mean().to(now[0].device) for a, b in zip(now, ref)]).mean()
        return 1.0 - cos

    def read_ahead(self, cap: int = 64) -> tuple[float, float]:
        """(runway, focus) of the newest draft query, from the active cache alone (one small matmul per layer).

        focus: the largest attention weight any RIFT layer's query head puts on a single importance entry (a copying
        head reads ~1.0 there; diffuse heads much less); runway: how many tokens right after that entry the cache
        still holds (capped at ``cap``). While a model copies from far back, its copying head reads position p, then
        p + 1, ...: the runway counts down one per generated token and reaches 0 where the selection stops, before
        acceptance falls; once nothing reads the importance part sharply (a stale selection, or novel text) the
        focus drops. (0, 0) without importance entries."""
        runway, focus = self.read_ahead_tensor(cap).tolist()
        return runway, focus

    def read_ahead_tensor(self, cap: int = 64) -> torch.Tensor:
        """``read_ahead`` as a (2,) float tensor [runway, focus] on the device, nothing read back to the host: over
        the layers, the largest focus, and the largest runway among the layers that reach it."""
        reads = [r for r in (layer.read_ahead(cap) for layer in self.rift_layers) if r is not None]
        device = self._device()
        if not reads:
            return torch.zeros(2, device=device)
        focus = torch.stack([f.to(device) for f, _ in reads])
        runway = torch.stack([r.to(device) for _, r in reads])
        best = focus.max()
        return torch.stack([torch.where(focus == best, runway, 0.0).max(), best])

    def _device(self) -> torch.device:
        layer = next((x for x in self.kv_layers if getattr(x, "is_initialized", False)), None)
        return layer.keys.device if layer is not None and layer.keys is not None else torch.device("cpu")

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
