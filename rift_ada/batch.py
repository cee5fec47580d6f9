"""Speculative decoding of a batch of sequences: ragged acceptance, a RIFT draft cache and a refresh per row.

``BatchDecoder.reset(prompts, max_new_tokens)`` prefills every row on its own (no padding anywhere: a prompt's
prefill is one forward over exactly its tokens); ``step(refresh)`` runs one round for every live row: each drafts on
its own compressed cache, the target verifies all of them in one forward, and each row keeps its own number of
accepted tokens, so lengths drift apart. A row that ends (EOS or its own ``max_new_tokens``) leaves the batch and
costs nothing more.

How rows live in one batch (docs/design.md "Batches"): every row keeps the caches a single-sequence decoder keeps
(a ``RiftCache`` for the draft: its own selection, window, backing store and refresh; a ``DynamicCache`` for the
target, with a hybrid target's recurrent states), and a forward over many rows goes through :class:`RowBatch`, a
transformers ``Cache`` that hands each row's keys and values to that row's cache and returns them stacked,
right-padded to the longest row, under a per-row mask built from each row's own layout (``row_mask``). Nothing about a
row depends on the others: its positions, its mask, what its cache stores and drops, its refresh. Padding keys are
masked, so a row's output is its own; and a row is never padded with tokens, so no row's cost grows with another's
prompt beyond the stacked attention's width. The round's per-row bookkeeping (acceptance, rollback, signals, the
record) is the single-sequence decoder's own (``SpeculativeDecoder.close_round``), one instance per row, so the two
cannot drift apart.

One draft length per round for the whole batch (as serving engines do); a row near its ``max_new_tokens`` drafts
fewer (``rounds.draft_count``), and rows verify in one forward per distinct length (almost always one).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache

from .ragged import RowLayer, TargetStore
from .recurrent import TargetStates
from .rift_layer import ROUND_SLACK, RiftLayer
from .rounds import accept, draft_count, entropy, sample, sampling_probs, unpack_outcomes
from .signals import DecoderState, observe
from .speculative import Clock, DecodeResult, RoundRecord, SpeculativeDecoder, check_prompt

__all__ = ["BatchDecoder", "BatchRound", "RowBatch", "batched_forward", "batched_greedy", "decide_rows",
           "joint_rows", "check_batch"]


# --- a forward over many rows, each with its own cache ---------------------------------------------------------------
def row_mask(layer, q: int, device) -> torch.Tensor:
    """(q, stored + q) bool: which of the entries ``layer.update`` will return (the stored ones, then the ``q`` new)
    each of the ``q`` new queries may see; computed before the forward, from the layer's own state. The same
    visibility the single-sequence path gets from transformers' masks and ``RiftLayer.window_mask``:

    - a RIFT layer: its importance entries always; tail and new positions p' <= p, and once the tail outgrows the
      window (mid-round), p' >= p - window;
    - a sliding layer (the draft's ``SlidingLayer`` or the target's own): p - window < p' <= p;
    - a full layer of the target: p' <= p."""
    length = layer.get_seq_length()
    if isinstance(layer, RowLayer):  # a target row: every stored entry is returned, the window is by position
        always, contiguous = 0, layer.stored
        window = None if layer.sliding_window is None else layer.sliding_window - 1
    elif isinstance(layer, RiftLayer):
        always, contiguous = layer.n_imp, layer.n_active - layer.n_imp
        window = layer.window if layer.window is not None and contiguous + q > layer.window + 1 else None
    else:
        always, contiguous = 0, (0 if getattr(layer, "keys", None) is None else layer.keys.shape[-2])
        sliding = getattr(layer, "sliding_window", None)
        window = None if sliding is None else sliding - 1
        if sliding is not None:  # a layer recording its past returns only the last window - 1 stored entries
            contiguous = min(contiguous, sliding - 1)
    kpos = torch.arange(length - contiguous, length + q, device=device)[None]
    qpos = torch.arange(length, length + q, device=device)[:, None]
    seen = kpos <= qpos
    if window is not None:
        seen &= kpos >= qpos - window
    return torch.cat([seen.new_ones(q, always), seen], dim=-1)


class RowBatch(Cache):
    """A transformers ``Cache`` over one cache per row, for one forward of the rows at once: ``update`` hands row
    j's keys and values to ``caches[j]`` and returns the rows' entries stacked, right-padded to the longest (the
    padding masked by :meth:`masks`); query observations go to each row's ``RiftCache``; a hybrid model's conv and
    recurrent states are stacked on read and written back per row (:meth:`finish`). Built per forward and thrown
    away: the rows' caches are the state."""

    def __init__(self, caches: Sequence):
        self.caches = list(caches)
        self.layers = self.caches[0].layers  # what transformers inspects (kinds, sliding flags)
        self._read: dict = {}  # (kind, layer, state index) -> stacked state handed to the model

    # -- keys and values
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        store = self._store_in_order(layer_idx)
        if store is not None:  # target rows that are their store's rows, in order: written in place, no copy
            layers = [c.layers[layer_idx] for c in self.caches]
            for j, layer in enumerate(layers):
                layer.write(key_states[j], value_states[j])
            width = max(layer.stored for layer in layers)
            return store.k[layer_idx][:, :, :width], store.v[layer_idx][:, :, :width]
        outs = [c.update(key_states[j:j + 1], value_states[j:j + 1], layer_idx)
                for j, c in enumerate(self.caches)]
        if len(outs) == 1:
            return outs[0]
        width = max(k.shape[-2] for k, _ in outs)
        k0, v0 = outs[0]
        keys = k0.new_zeros(len(outs), k0.shape[1], width, k0.shape[-1])
        values = v0.new_zeros(len(outs), v0.shape[1], width, v0.shape[-1])
        for j, (k, v) in enumerate(outs):
            keys[j, :, :k.shape[-2]] = k[0]
            values[j, :, :v.shape[-2]] = v[0]
        return keys, values

    def _store_in_order(self, layer_idx: int):
        """The TargetStore behind this layer when the batch's rows are exactly its rows, in order; else None."""
        first = self.caches[0].layers[layer_idx]
        if not isinstance(first, RowLayer):
            return None
        store = first.store
        if store.rows != len(self.caches) or any(c.layers[layer_idx].store is not store or c.layers[layer_idx].row != j
                                                 for j, c in enumerate(self.caches)):
            return None
        return store

    def masks(self, config, q: int, device, dtype=None):
        """The attention mask for a forward of ``q`` new tokens per row: (rows, 1, q, width) per layer type, as a
        dict by ``config.layer_types`` (None for recurrent layers, which see no padding: every row feeds q real
        tokens) or one tensor for a model without layer types (every layer then has the first layer's kind). Bool
        (True: may attend), or additive in ``dtype`` for a model whose eager attention adds its mask (GPT-OSS)."""
        types = getattr(config.get_text_config(decoder=True), "layer_types", None)
        if not types:
            first = next(i for i, layer in enumerate(self.layers) if hasattr(layer, "get_seq_length"))
            return self._mask(first, q, device, dtype)
        out = {}
        for i, name in enumerate(types):
            if name not in out:
                out[name] = (None if name in ("linear_attention", "mamba", "mlp", "moe")
                             else self._mask(i, q, device, dtype))
        return out

    def _mask(self, layer_idx: int, q: int, device, dtype=None) -> torch.Tensor:
        rows = [row_mask(c.layers[layer_idx], q, device) for c in self.caches]
        width = max(m.shape[-1] for m in rows)
        mask = torch.zeros(len(rows), 1, q, width, dtype=torch.bool, device=device)
        for j, m in enumerate(rows):
            mask[j, 0, :, :m.shape[-1]] = m
        if dtype is None:
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(c.get_seq_length(layer_idx) for c in self.caches)

    @property
    def is_sliding(self):
        return self.caches[0].is_sliding

    # -- query observation (rift_ada.attention calls these for a forward passed rift_observer=<this>)
    def observe_queries(self, layer_idx: int, query, positions=None) -> None:
        for j, c in enumerate(self.caches):
            c.observe_queries(layer_idx, query[j:j + 1], None if positions is None else positions[j])

    def window_mask(self, layer_idx: int, q: int):
        return None  # already in masks()

    # -- linear-attention / Mamba states (hybrid models)
    def is_recording_past(self, layer_idx: int) -> bool:
        return self.caches[0].is_recording_past(layer_idx)

    def _get(self, kind: str, layer_idx: int, state_idx: int):
        parts = [getattr(c, f"get_{kind}_state")(layer_idx, state_idx) for c in self.caches]
        if any(p is None for p in parts):
            return None
        stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
        if len(parts) > 1:  # a fused kernel may update it in place: written back by finish()
            self._read[(kind, layer_idx, state_idx)] = stacked
        return stacked

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._get("conv", layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._get("recurrent", layer_idx, state_idx)

    def _update(self, kind: str, states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._read.pop((kind, layer_idx, state_idx), None)  # the rows take the new states themselves
        outs = [getattr(c, f"update_{kind}_state")(states[j:j + 1], layer_idx, state_idx, **kwargs)
                for j, c in enumerate(self.caches)]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._update("conv", conv_states, layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._update("recurrent", recurrent_states, layer_idx, state_idx, **kwargs)

    def finish(self) -> None:
        """Write back, row by row, the stacked states a kernel updated in place (Qwen3.5's single-token conv)."""
        for (kind, layer_idx, state_idx), stacked in self._read.items():
            for j, c in enumerate(self.caches):
                getattr(c, f"get_{kind}_state")(layer_idx, state_idx).copy_(stacked[j:j + 1])
        self._read = {}


def batched_forward(model, caches: Sequence, tokens: Sequence[Sequence[int]], device, observe: bool = False,
                    all_logits: bool = False) -> torch.Tensor:
    """``model``'s logits after feeding row j's ``tokens[j]`` (every row the same count, q) at its own positions over
    ``caches[j]``: (rows, q, vocab) with ``all_logits``, else (rows, vocab) at each row's last token. ``observe``
    records the queries of RiftCaches. One row is the single-sequence forward itself."""
    ids = torch.tensor(tokens, device=device)
    q = ids.shape[1]
    starts = torch.tensor([c.get_seq_length() for c in caches], device=device)
    pos = starts[:, None] + torch.arange(q, device=device)[None]
    keep = 0 if all_logits else 1
    if len(caches) == 1:
        extra = {"rift_observer": caches[0]} if observe else {}
        logits = model(ids, cache=caches[0], position_ids=pos, logits_to_keep=keep, **extra).logits
    else:
        batch = RowBatch(caches)
        extra = {"rift_observer": batch} if observe else {}
        # Eager attention adds its mask to the scores; SDPA and the observers over it take a boolean one.
        additive = model.config._attn_implementation in ("eager", "rift_eager")
        mask = batch.masks(model.config, q, device, model.dtype if additive else None)
        logits = model(ids, cache=batch, position_ids=pos, attention_mask=mask, logits_to_keep=keep, **extra).logits
        batch.finish()
    return logits if all_logits else logits[:, -1]


# --- checks ----------------------------------------------------------------------------------------------------------
def check_batch(prompts, max_new_tokens, models, device) -> tuple[list[list[int]], list[int]]:
    """(prompts as lists, max_new_tokens per row), or ValueError in one line: no prompts, an empty prompt, a
    ``max_new_tokens`` list of the wrong length, or a row that ``check_prompt`` refuses (beyond the models'
    context), named."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    rows = [list(map(int, p)) for p in prompts]
    if not rows:
        raise ValueError("the batch holds no prompts")
    news = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(rows)
    if len(news) != len(rows):
        raise ValueError(f"{len(news)} max_new_tokens for a batch of {len(rows)} prompts")
    for i, (p, n) in enumerate(zip(rows, news)):
        if not p:
            raise ValueError(f"prompt {i} of the batch is empty")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r} for row {i}")
        try:
            check_prompt(p, n, models, device)  # the single decoder's rule for what fits the context
        except ValueError as e:
            raise ValueError(f"row {i} of the batch: {e}") from None
    return rows, news


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes one token's keys and values take over every attention layer of a model."""
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def estimate_bytes(target, draft, layout, lengths: Sequence[int]) -> int:
    """What a batch's caches take at their largest, before any is allocated: the target's store (every row at the
    longest row's final length, ``rift_ada.ragged``) and one row's prefill beside it, the draft's backing store (a
    refreshable layout) or its full cache (``full``) per row, and the stacked copy a forward makes of the draft's
    entries. An upper bound, used to refuse a batch that cannot fit, in one line, instead of failing inside a
    forward."""
    nbytes = lambda m: next(m.parameters()).element_size()  # noqa: E731
    t = kv_bytes_per_token(target.config, nbytes(target))
    d = kv_bytes_per_token(draft.config, nbytes(draft))
    total, longest = sum(lengths), max(lengths)
    draft_tokens = total if (layout.refreshable or not layout.compress) else len(lengths) * (layout.budget or 0)
    stacked = len(lengths) * min(longest, 2 * (layout.budget or longest))
    return t * (len(lengths) * longest + longest) + d * (draft_tokens + stacked)


def available_bytes(device) -> int | None:
    """Free memory on ``device`` (CUDA: the allocator's free bytes; CPU: MemAvailable), None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --- per-row decisions -----------------------------------------------------------------------------------------------
def decide_rows(controller, states: Sequence[DecoderState]) -> list[bool]:
    """Each row's refresh from its own state: a refresh controller's ``decide_batch`` over the rows' observations
    (one call: vectorised where the kind provides it), or ``decide`` row by row; None never refreshes. A controller
    that decides otherwise is refused in one line (a joint controller's (refresh, draft length): ``joint_rows``)."""
    if controller is None:
        return [False] * len(states)
    if not hasattr(controller, "decide"):
        raise ValueError(f"{type(controller).__name__} cannot decide a refresh per row: a batch needs a refresh "
                        "controller (rift_ada.refresh) with decide(observation) or decide_batch(observations)")
    obs = np.stack([observe(s) for s in states]) if states else np.zeros((0, 0), np.float32)
    many = getattr(controller, "decide_batch", None)
    out = many(obs) if many is not None else [controller.decide(o) for o in obs]
    out = [bool(x) for x in np.asarray(out).reshape(-1)]
    if len(out) != len(states):
        raise ValueError(f"{type(controller).__name__}.decide_batch gave {len(out)} decisions for {len(states)} rows")
    return out


def joint_rows(controller, states: Sequence[DecoderState]) -> tuple[list[bool], int]:
    """A joint controller (``rift_ada.joint``) in a batch: each live row's (refresh, k) from its own state, priced at
    that row's own context length (its prompt plus what it generated so far: ``DecoderState``), then one k for
    the round, the one most rows chose (ties: the larger), as a serving engine picks one draft length for its batch.
    Each row refreshes as it chose (a refresh with the round's k = 0 waits: a plain step never reads the draft)."""
    if not hasattr(controller, "act"):
        raise ValueError(f"{type(controller).__name__} is not a joint controller (it has no act(state))")
    acts = [controller.act(s) for s in states]
    votes: dict[int, int] = {}
    for _, k in acts:
        votes[int(k)] = votes.get(int(k), 0) + 1
    k = max(votes, key=lambda x: (votes[x], x))
    return [bool(r) and k > 0 for r, _ in acts], k


# --- the decoder -----------------------------------------------------------------------------------------------------
@dataclass
class BatchRound:
    """One batched round: the records of the rows that took part (row index -> its ``RoundRecord``), and the
    round's wall time by phase for the whole batch (each row's record carries these same shared seconds)."""

    records: dict[int, RoundRecord]
    draft_length: int
    seconds: dict[str, float] = field(default_factory=dict)
    forwards: int = 0  # model forwards the round ran (draft steps + verify groups + hybrid replays)


class BatchDecoder:
    """Speculative decoding of many prompts at once, each row with its own RIFT draft cache (``layout``'s budget per
    row), its own refreshes and its own acceptance. Settings as :class:`~rift_ada.speculative.SpeculativeDecoder`
    (it builds one, whose checks refuse what it cannot run); row i samples from its own generator, seeded
    ``seed + i``, so each row draws exactly as that decoder would alone with that seed.

    ``reset(prompts, max_new_tokens)``, then ``step(refresh=[per live row])`` until ``done``; ``states`` are the live
    rows' published states (``rift_ada.signals.DecoderState``), ``results`` every row's ``DecodeResult``."""

    def __init__(self, target, draft=None, layout=None, draft_length: int = 11, temperature: float = 0.0,
                 top_p: float = 1.0, eos_token_id: int | None = None, seed: int = 0, store_device=None,
                 top_k: int = 0, draft_step: str = "model", verify_step: str = "model",
                 prefill_chunk: int | str = "auto", memory_limit: int | None = None):
        if draft_step != verify_step:
            raise ValueError(f"a batch runs both steps the same way (model, static or compiled), got draft_step "
                             f"{draft_step!r} and verify_step {verify_step!r}")
        self.template = SpeculativeDecoder(target, draft, layout, draft_length, temperature, top_p, eos_token_id,
                                           seed, store_device, top_k, prefill_chunk=prefill_chunk)
        self.step_kind = draft_step
        if draft_step != "model":  # refuse what the static steps cannot run now, in one line, not at the first round
            from .static import check_static

            check_static(self.template.draft, kinds=self.template.kinds[1])
            check_static(self.template.target, role="target", kinds=self.template.kinds[0])
            if draft_length + 1 > ROUND_SLACK:
                raise ValueError(f"the static steps draft at most {ROUND_SLACK - 1} tokens a round (k), got "
                                 f"{draft_length}")
        self._static: dict[int, tuple] = {}  # rows -> (draft step, verify): kept, so compiled graphs are reused
        self.host_reads = 0  # static rounds: reads of the device's results (one per round)
        t = self.template
        self.target, self.draft, self.layout, self.k = t.target, t.draft, t.layout, t.k
        self.temperature, self.eos_token_id, self.device = t.temperature, t.eos_token_id, t.device
        self.memory_limit = memory_limit
        self.rows: list[SpeculativeDecoder] = []
        self.history: list[BatchRound] = []

    @classmethod
    def for_pair(cls, pair, layout, decoding, draft=None, store_device=None) -> "BatchDecoder":
        return cls(pair.target, pair.draft if draft is None else draft, layout, decoding.draft_length,
                   temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k,
                   eos_token_id=pair.tokenizer.eos_token_id, seed=decoding.seed, store_device=store_device,
                   draft_step=decoding.draft_step, verify_step=decoding.verify_step)

    # --- a generation
    @torch.inference_mode()
    def reset(self, prompts, max_new_tokens) -> None:
        """Prefill every row (one at a time, exactly its own tokens) and take each row's first token."""
        t = self.template
        rows, news = check_batch(prompts, max_new_tokens, (self.target, self.draft), self.device)
        lengths = [len(p) + n + self.k + 1 for p, n in zip(rows, news)]
        need = estimate_bytes(self.target, self.draft, self.layout, lengths)
        free = self.memory_limit if self.memory_limit is not None else available_bytes(self.device)
        if free is not None and need > free:
            raise ValueError(f"a batch of {len(rows)} rows up to {max(lengths)} tokens needs about "
                             f"{need / 2**30:.1f} GiB of caches, more than the {free / 2**30:.1f} GiB free on "
                             f"{self.device}: fewer rows or shorter prompts")
        self.rows, self.history = [], []
        static = self.step_kind != "model"
        if static:
            from .static_batch import BatchStaticKV

            self.store = BatchStaticKV(len(rows), max(lengths))
        else:
            self.store = TargetStore(len(rows), max(lengths))
        for i, (ids, n) in enumerate(zip(rows, news)):
            row = copy.copy(t)
            row.seed = t.seed + i
            row._prefilled = None
            row.reset(ids, n)
            # The row's target cache moves into the batch's store; its prefill's own cache goes.
            row.tcache = self.store.load(i, row.tcache) if static else self.store.adopt(i, row.tcache)
            row.target_states = TargetStates(row.tcache)
            self.rows.append(row)
        self._stored = list(range(len(rows)))  # which row each of the store's rows is
        if static:
            self._prepare_static(max(lengths))

    def _prepare_static(self, capacity: int) -> None:
        """The static steps of this batch size (built once, so compiled graphs are reused) and every row's draft
        cache in the draft step's arena."""
        from .static_batch import BatchDraftStep, BatchVerify

        rows, compile = len(self.rows), self.step_kind == "compiled"
        if rows not in self._static:
            sampling = self.template.sampling
            self._static[rows] = (BatchDraftStep(self.draft, rows, compile, sampling),
                                  BatchVerify(self.target, rows, self.k + 1, compile))
        self.static_draft, self.static_verify = self._static[rows]
        self.static_draft.prepare([r.dcache for r in self.rows], capacity)

    @property
    def done(self) -> bool:
        return all(r.done for r in self.rows)

    @property
    def live(self) -> list[int]:
        """Indices of the rows still generating, in batch order."""
        return [i for i, r in enumerate(self.rows) if not r.done]

    @property
    def states(self) -> list[DecoderState]:
        """The live rows' published states, in ``live`` order."""
        return [self.rows[i].state for i in self.live]

    @property
    def results(self) -> list[DecodeResult]:
        return [r.result for r in self.rows]

    def rounds(self, decide=None, draft_length=None):
        """The decode loop: each round, ``decide(states) -> [refresh per live row]`` (None: never) and
        ``draft_length(states) -> k`` (None: the decoder's), until every row ends. Yields each ``BatchRound``."""
        while not self.done:
            states = self.states if decide is not None or draft_length is not None else None
            refresh = None if decide is None else decide(states)
            k = None if draft_length is None else draft_length(states)
            yield self.step(refresh, k)

    # --- a round
    @torch.inference_mode()
    def step(self, refresh: Sequence[bool] | None = None, draft_length: int | None = None) -> BatchRound:
        """One round for every live row: [refresh the rows asked] -> draft -> one verify forward -> accept per row
        -> roll back per row -> each row's record and state."""
        live = self.live
        if not live:
            raise RuntimeError("generation is finished: call reset() with new prompts")
        if live != self._stored and self.step_kind == "model":  # rows ended: the store keeps the live ones
            self.store.keep([self._stored.index(i) for i in live])
            self._stored = live
        refresh = [False] * len(live) if refresh is None else [bool(x) for x in refresh]
        if len(refresh) != len(live):
            raise ValueError(f"{len(refresh)} refresh decisions for {len(live)} live rows")
        k = self.k if draft_length is None else draft_length
        if not (isinstance(k, int) and 0 <= k <= self.k):
            raise ValueError(f"a round's draft_length must be an integer in [0, {self.k}], got {k!r}")
        if self.step_kind != "model":
            return self._step_on_device(live, refresh, k)
        rows = [self.rows[i] for i in live]
        before = [(len(r.result.tokens), r.tokens_since_refresh) for r in rows]
        clock = Clock(self.template._sync)
        for r, f in zip(rows, refresh):
            if f:
                r.dcache.refresh()
        clock.lap("refresh")
        ks = [draft_count(k, gen, r.max_new_tokens) for r, (gen, _) in zip(rows, before)]
        signals = [r.resolve_signals() for r in rows]
        with self.template.drafting():  # a self-drafter's adapter on (rift_ada.lora.load_self_drafter)
            drafts, q_probs, entropies, forwards = self._draft(rows, ks)
        active = [r.dcache.active_bytes_by_kind() for r in rows]
        clock.lap("draft")
        t_logits, groups = self._verify(rows, ks, drafts)
        outcomes = [r.outcome(d, *accept(d, q, t, r.generator, *r.sampling), e, t)
                    for r, d, q, t, e in zip(rows, drafts, q_probs, t_logits, entropies)]
        clock.lap("verify")
        replayed = [r.roll_back(kr, o.accepted, o.drafts, o.next_token) for r, kr, o in zip(rows, ks, outcomes)]
        clock.lap("rollback")
        records = {i: r.close_round(gen, since, f, kr, o, s, a, rep, clock.seconds)
                   for i, r, (gen, since), f, kr, o, s, a, rep in
                   zip(live, rows, before, refresh, ks, outcomes, signals, active, replayed)}
        out = BatchRound(records, k, dict(clock.seconds), forwards + groups + sum(replayed))
        self.history.append(out)
        return out

    def _step_on_device(self, live: list[int], refresh: list[bool], k: int) -> BatchRound:
        """A batched round on the static steps: every row (those that ended idle, so the shapes never change)
        drafts in the arena, verifies its block, and the acceptance runs on the device; the round's outcomes and the
        unread signals of every live row come back in one read (``host_reads``)."""
        rows = self.rows
        before = {i: (len(rows[i].result.tokens), rows[i].tokens_since_refresh) for i in live}
        clock = Clock(self.template._sync if self.template.phase_sync else None)
        for i, f in zip(live, refresh):
            if f:
                rows[i].dcache.refresh()
        clock.lap("refresh")
        ks = [draft_count(k, before[i][0], r.max_new_tokens) if i in before else 0 for i, r in enumerate(rows)]
        pendings = []
        with self.template.drafting():  # a self-drafter's adapter on (rift_ada.lora.load_self_drafter)
            for i, r in enumerate(rows):
                pending = r.draft_pending if i in before and ks[i] else [0]  # a row not drafting feeds nothing
                if len(pending) > 2:  # after plain steps: all but the last fed by the model in chunks
                    pending = r.catch_up(pending)
                pendings.append(pending)
            drafts, q_probs, entropies = self.static_draft.round([r.dcache for r in rows], pendings, ks,
                                                                 [r.generator for r in rows])
        active = {i: rows[i].dcache.active_bytes_by_kind() for i in live}
        clock.lap("draft")
        firsts = [r.target_pending[0] if i in before else 0 for i, r in enumerate(rows)]
        grow = [ks[i] if i in before else -1 for i in range(len(rows))]  # -1: an ended row's length stays
        t_logits = self.static_verify.on_device(self.store, firsts, drafts, grow)
        unread = [rows[i].unread_signals() for i in live]
        packed = [rows[i].device_outcome(drafts[i, :ks[i]], None if q_probs is None else q_probs[i, :ks[i]],
                                         entropies[i, :ks[i]], t_logits[i]) for i in live]
        values = torch.cat(packed).tolist()  # the round's one read of the device
        self.host_reads += 1
        outcomes = unpack_outcomes(values, [ks[i] for i in live], self.temperature > 0, unread)
        clock.lap("verify")
        for i, o in zip(live, outcomes):
            rows[i].take_signals(o)
        replayed = [rows[i].roll_back(ks[i], o.accepted, o.drafts, o.next_token) for i, o in zip(live, outcomes)]
        clock.lap("rollback")
        records = {i: rows[i].close_round(*before[i], f, ks[i], o, rows[i].published_signals, active[i], rep,
                                          clock.seconds) for i, f, o, rep in zip(live, refresh, outcomes, replayed)}
        out = BatchRound(records, k, dict(clock.seconds), max(len(p) + kr - 1 for p, kr in zip(pendings, ks)) + 1)
        self.history.append(out)
        return out

    def _draft(self, rows, ks):
        """Every row's drafts, the distributions they were drawn from and the draft's entropies, one batched forward
        per draft step over the rows still drafting. A row's pending tokens (two after a round that accepted every
        draft, more after plain steps) are fed first, all but the last, by the rows that have them."""
        n = len(rows)
        drafts, q_probs, entropies = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        drafting = [i for i in range(n) if ks[i] > 0]
        forwards = 0
        early = {}  # rows with more than one pending token, by how many come before the last
        for i in drafting:
            if len(rows[i].draft_pending) > 1:
                early.setdefault(len(rows[i].draft_pending) - 1, []).append(i)
        for idx in early.values():
            batched_forward(self.draft, [rows[i].dcache for i in idx], [rows[i].draft_pending[:-1] for i in idx],
                            self.device, observe=True)
            forwards += 1
        feed = {i: rows[i].draft_pending[-1:] for i in drafting}
        for step in range(max(ks, default=0)):
            idx = [i for i in drafting if ks[i] > step]
            logits = batched_forward(self.draft, [rows[i].dcache for i in idx], [feed[i] for i in idx], self.device,
                                     observe=True)
            forwards += 1
            ent = entropy(logits).tolist()
            greedy = logits.argmax(-1).tolist() if self.temperature == 0 else None
            for j, i in enumerate(idx):
                r = rows[i]
                if step < ks[i] - 1:  # a hybrid draft's states after this token (no-op for attention-only drafts)
                    r.dcache.checkpoint()
                q = sampling_probs(logits[j], *r.sampling)
                tok = greedy[j] if greedy is not None else sample(q, logits[j], r.generator)
                drafts[i].append(tok)
                q_probs[i].append(q)
                entropies[i].append(ent[j])
                feed[i] = [tok]
        return drafts, q_probs, entropies, forwards

    def _verify(self, rows, ks, drafts):
        """The target's logits at each row's pending token and drafts ((k_i + 1, vocab) per row): one forward for
        the rows of each draft count (all of them but for rows near their end). A hybrid target's states are
        copied first (``TargetStates.take``) for the rollback."""
        out = [None] * len(rows)
        groups = {}
        for i, kr in enumerate(ks):
            groups.setdefault(kr, []).append(i)
        for idx in groups.values():
            for i in idx:
                rows[i].target_states.take()
            logits = batched_forward(self.target, [rows[i].tcache for i in idx],
                                     [rows[i].target_pending + drafts[i] for i in idx], self.device, all_logits=True)
            for j, i in enumerate(idx):
                out[i] = logits[j]
        return out, len(groups)


def batched_greedy(target, prompts, max_new_tokens, eos_token_id: int | None = None, device=None,
                   step: str = "model") -> tuple[list[list[int]], list[float]]:
    """Plain greedy decoding of a batch with the target alone (the baseline a batch's speculation is measured
    against), on the same machinery as the batch's verify: each row prefilled on its own, then one forward for the
    rows per token (``step`` "model": the model's forward over the rows' ``TargetStore``, rows leaving as they end;
    "static" / "compiled": ``rift_ada.static_batch.BatchVerify`` of one token per row over a ``BatchStaticKV``, rows
    that ended idling, one read of the tokens per step). (each row's tokens, each step's seconds)."""
    from transformers import DynamicCache

    device = device or target.device
    rows, news = check_batch(prompts, max_new_tokens, (target,), device)
    out, seconds, caches = [], [], []
    capacity = max(len(p) + n for p, n in zip(rows, news))
    if step != "model":
        from .static_batch import BatchStaticKV, BatchVerify

        store = BatchStaticKV(len(rows), capacity)
        verify = BatchVerify(target, len(rows), 1, compile=step == "compiled")
        nothing = torch.zeros(len(rows), 0, dtype=torch.long, device=device)
    else:
        store = TargetStore(len(rows), capacity)
    with torch.inference_mode():
        for i, ids in enumerate(rows):  # each row's prefill moves into the store as soon as it is done
            cache = DynamicCache(config=target.config)
            logits = target(torch.tensor([ids], device=device), cache=cache, logits_to_keep=1).logits[0, -1]
            caches.append(store.load(i, cache) if step != "model" else store.adopt(i, cache))
            out.append([int(logits.argmax())])
        live = [i for i in range(len(rows)) if news[i] > 1 and out[i][-1] != eos_token_id]
        stored = list(range(len(rows)))
        while live:
            t0 = time.perf_counter()
            if step != "model":
                grow = [0 if i in live else -1 for i in range(len(rows))]
                logits = verify.on_device(store, [t[-1] for t in out], nothing, grow)[:, 0]
                tokens = logits.argmax(-1).tolist()
                new = {i: tokens[i] for i in live}
            else:
                if live != stored:
                    store.keep([stored.index(i) for i in live])
                    stored = live
                logits = batched_forward(target, [caches[i] for i in live], [out[i][-1:] for i in live], device)
                new = dict(zip(live, logits.argmax(-1).tolist()))
            for i, tok in new.items():
                out[i].append(tok)
            seconds.append(time.perf_counter() - t0)
            live = [i for i in live if len(out[i]) < news[i] and out[i][-1] != eos_token_id]
    return out, seconds
