"""Drafting for an engine that verifies: one RIFT draft cache per live request, kept in step with the tokens the
engine has verified (``DraftPool``). The engine owns the target, the batch and the acceptance; this module owns only
the draft side of each request: its compressed cache (budget, window, backing store), its refreshes and the signals
a controller decides them from. ``rift_ada.vllm_proposer`` plugs it into vLLM; nothing here imports an engine.

What an engine hands over each step is, per row, the row's verified context (prompt + every token it emitted), and
nothing else: no request id, no acceptance count, no finish notice (vLLM's ``custom_class`` proposer interface). So:

- **identity by prefix**: a row belongs to the sequence whose last verified context is a prefix of the row's context
  (rows move between batch slots as requests come and go; two requests with one prompt hold the same tokens, so
  either cache serves either row until they part). A row that extends no sequence is a new request: its draft is
  prefilled on its context. A sequence that no row extends has finished (or been preempted: it is prefilled again if
  it returns), and its cache is dropped at once, so the draft holds budget x live requests.
- **acceptance from the context**: the tokens that follow a sequence's last context are its accepted drafts, then
  the engine's own token; the draft cache rolls back what the engine rejected (``RiftCache.rollback``), as
  ``SpeculativeDecoder.roll_back`` does.
- **the decoder's signals**: acceptance history, draft entropy, runway, focus and query drift are kept exactly as
  ``SpeculativeDecoder`` keeps them (``rift_ada.signals``), so an exported controller decides refreshes here as it
  does in rift-ada's own loop. The target's probability of what it emitted is not handed over (``target_p`` reads
  1.0, as in greedy decoding), and the generation length is the pool's ``max_new_tokens`` setting.

Drafts are the draft's greedy tokens, proposed as points (an engine without draft probabilities verifies each
proposal against the target's distribution, which keeps sampling exact). All rows draft in one batched forward per
draft step (``rift_ada.batch.batched_forward``: per-row caches behind one ``Cache``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .architectures import layer_kinds
from .attention import check_observable
from .batch import batched_forward, decide_rows
from .cache import RiftCache
from .layout import CacheLayout
from .rounds import entropy
from .signals import (FRESH, RUNWAY_CAP, DecoderState, acceptance, recent_after, since_refresh_after, suffix_match)
from .speculative import chunked_forward, prefill_chunk_for

__all__ = ["DraftPool", "DraftSequence", "PoolStats"]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class PoolStats:
    """What the pool did since it was made: the engine's rounds as the drafts saw them."""

    rounds: int = 0  # rounds whose verdict came back (a row's next context after it drafted)
    drafted: int = 0
    accepted: int = 0
    refreshes: int = 0
    prefills: int = 0  # sequences started (a request, or a preempted one that came back)
    generated: int = 0  # tokens the engine emitted in those rounds
    peak_active_bytes: int = 0  # the draft caches' active attention KV at their largest (all live sequences)
    peak_live: int = 0
    seconds: float = 0.0  # wall time inside ``propose`` (the draft's whole share of a step)
    prefill_seconds: float = 0.0  # ... of it prefilling new sequences

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify round (accepted drafts + the target's own), as rift-ada's ``metrics`` define AL."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def refreshes_per_1k(self) -> float:
        return 1000.0 * self.refreshes / self.generated if self.generated else 0.0


class DraftSequence:
    """One request's draft side: its RIFT cache, the context the engine last verified, the drafts proposed on it,
    and the signal bookkeeping of ``SpeculativeDecoder._publish``."""

    def __init__(self, cache: RiftCache, context: np.ndarray, vocab_size: int, max_new_tokens: int):
        self.cache, self.context = cache, context
        self.prompt_len = len(context) - 1  # the draft was prefilled on the prompt; the engine's first token pends
        self.vocab_size, self.max_new_tokens = vocab_size, max_new_tokens
        self.drafts: list[int] = []
        self.entropies: list[float] = []
        self.refreshed = False
        self.since = 0
        self.rounds = self.drafted = self.accepted = 0
        self.recent: tuple[float, ...] = ()
        self.fresh: list[float] = []
        self.entropy_mean = self.entropy_max = 0.0
        self.drift_floor: float | None = None
        self.signals = self._cache_signals()
        self.state: DecoderState | None = None

    @property
    def pending(self) -> np.ndarray:
        """The verified tokens the draft has not been fed yet (one, or two after a round that accepted every draft)."""
        return self.context[self.cache.get_seq_length():]

    def advance(self, context: np.ndarray) -> tuple[int, int, int]:
        """The engine verified the last drafts and now holds ``context`` (extending the last one): roll back what it
        rejected and close the round's bookkeeping. Returns (drafts proposed, accepted, tokens emitted)."""
        before = len(self.context)
        emitted = len(context) - before
        k = len(self.drafts)
        n = common_prefix(np.asarray(self.drafts, dtype=context.dtype), context[before:before + k])
        fed = self.cache.get_seq_length()  # the last context but its pending tokens, then k - 1 drafts
        kept = min(fed, before + min(n, max(k - 1, 0)))
        if k:
            self.cache.rollback(fed - kept)
        self.context, self.drafts = context, []
        self.since = since_refresh_after(self.since, self.refreshed, emitted)
        if self.refreshed:
            self.fresh, self.drift_floor = [], None
        if len(self.fresh) < FRESH and k:
            self.fresh.append(acceptance(n, k))
        self.recent = recent_after(self.recent, n, k)
        self.rounds, self.drafted, self.accepted = self.rounds + 1, self.drafted + k, self.accepted + n
        ent = self.entropies[:n + 1]  # the steps drafted on the emitted text (SpeculativeDecoder.close_round)
        self.entropy_mean = sum(ent) / len(ent) if ent else 0.0
        self.entropy_max = max(ent, default=0.0)
        self.entropies, self.refreshed = [], False
        self.signals, self.state = self._cache_signals(), None
        return k, n, emitted

    def _cache_signals(self) -> tuple[float, float, float, float]:
        """(runway, focus, drift, drift floor), read off the draft cache as the decoder reads them."""
        runway, focus = (float(x) for x in self.cache.read_ahead_tensor(RUNWAY_CAP).tolist())
        drift = float(self.cache.query_drift_tensor())
        if self.drift_floor is None:
            self.drift_floor = drift
        return runway, focus, drift, self.drift_floor

    def decoder_state(self) -> DecoderState:
        """The state a refresh decision reads (``rift_ada.signals``), as ``SpeculativeDecoder.state`` builds it."""
        if self.state is None:
            runway, focus, drift, floor = self.signals
            generated = len(self.context) - self.prompt_len
            self.state = DecoderState(
                generated=generated, max_new_tokens=max(self.max_new_tokens, generated), rounds=self.rounds,
                tokens_since_refresh=self.since, drift=drift, acceptance=self.recent,
                entropy_mean=self.entropy_mean, entropy_max=self.entropy_max, vocab_size=self.vocab_size,
                runway=runway, focus=focus, fresh=tuple(self.fresh), drift_floor=floor,
                prompt_tokens=self.prompt_len, drafted_total=self.drafted, accepted_total=self.accepted,
                match=suffix_match(self.context))
        return self.state

    def refresh(self) -> None:
        self.cache.refresh()
        self.refreshed = True


class DraftPool:
    """The draft side of speculative decoding for an engine's batch: ``propose(contexts)`` -> k drafts per row.

    ``model``: the draft (a supported architecture, ``rift_ada.architectures``); ``layout``: its cache
    (``rift_ada.layout``); ``controller``: when to refresh (a ``rift_ada.refresh`` controller, None: never);
    ``max_new_tokens``: what the ``position`` signal divides the generated length by (engines do not say);
    ``max_len``: the engine's context limit (no draft runs past it)."""

    def __init__(self, model, layout: CacheLayout, controller=None, draft_length: int = 11,
                 max_new_tokens: int = 1024, max_len: int | None = None, store_device=None,
                 prefill_chunk: int | str = "auto"):
        if not isinstance(draft_length, int) or draft_length < 1:
            raise ValueError(f"draft length k must be an integer >= 1, got {draft_length!r}")
        if controller is not None and not layout.refreshable:
            raise ValueError(f"a refresh controller needs a refreshable cache; {layout.describe()} has no backing "
                             "store (policy rift-dyn or rift-ada)")
        self.kinds = layer_kinds(model.config)  # a draft rift-ada cannot roll back is refused here, in one line
        check_observable(model, self.kinds)
        self.model, self.layout, self.controller = model, layout, controller
        self.k, self.max_new_tokens, self.store_device = draft_length, max_new_tokens, store_device
        self.max_len = max_len or getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.device = model.device
        self.prefill_chunk = prefill_chunk_for(prefill_chunk, self.device)
        self.sequences: list[DraftSequence] = []
        self.stats = PoolStats()

    # --- a step ------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, contexts: Sequence[np.ndarray | Sequence[int] | None]) -> list[list[int]]:
        """Drafts for each row: ``contexts[i]`` is row i's verified tokens (None or empty: the row drafts nothing
        this step, e.g. a prefill still in progress). Rows are matched to their sequences, caches rolled back and
        refreshed as decided, then every drafting row drafts in one batched forward per step."""
        start = time.perf_counter()
        rows = [None if c is None or len(c) == 0 else np.asarray(c, dtype=np.int64) for c in contexts]
        seqs = self._match(rows)
        live = [i for i, s in enumerate(seqs) if s is not None]
        # A row whose drafts the engine has not verified yet (the same context again) keeps them: no new round.
        deciding = [i for i in live if not seqs[i].drafts]
        if self.controller is not None and deciding:
            for i, refresh in zip(deciding, decide_rows(self.controller, [seqs[i].decoder_state() for i in deciding])):
                if refresh:
                    seqs[i].refresh()
                    self.stats.refreshes += 1
        ks = {i: min(self.k, self.max_len - len(seqs[i].context)) for i in live}
        drafts = self._draft([i for i in live if ks[i] > 0], seqs, ks)
        active = sum(s.cache.active_bytes() for s in self.sequences)
        self.stats.peak_active_bytes = max(self.stats.peak_active_bytes, active)
        self.stats.peak_live = max(self.stats.peak_live, len(self.sequences))
        self.stats.seconds += time.perf_counter() - start
        return [drafts.get(i, []) for i in range(len(rows))]

    def _match(self, rows: list[np.ndarray | None]) -> list[DraftSequence | None]:
        """Each row's sequence (advanced to the row's context), a new one for a row that extends none; sequences no
        row extends are dropped. The longest matching context wins (two requests that share a prefix part there)."""
        free = list(self.sequences)
        out: list[DraftSequence | None] = [None] * len(rows)
        for i, ctx in enumerate(rows):
            if ctx is None:
                continue
            best = None
            for s in free:
                n = len(s.context)
                if n <= len(ctx) and (best is None or n > len(best.context)) and np.array_equal(s.context, ctx[:n]):
                    best = s
            if best is not None:
                free.remove(best)
                if len(ctx) > len(best.context):
                    k, n, emitted = best.advance(ctx)
                    self.stats.rounds += 1
                    self.stats.drafted, self.stats.accepted = self.stats.drafted + k, self.stats.accepted + n
                    self.stats.generated += emitted
                out[i] = best
        dropped = set(map(id, free))
        self.sequences = [s for s in self.sequences if id(s) not in dropped]
        # A row still pending at its last context (the engine ran no verify for it) keeps its drafts' cache state;
        # new rows are prefilled after the drop, so a finished request's memory is free first.
        for i, ctx in enumerate(rows):
            if ctx is not None and out[i] is None:
                out[i] = self._start(ctx)
        return out

    def _start(self, context: np.ndarray) -> DraftSequence:
        """A new sequence: the draft prefilled on the context but its last token, compressed under the layout."""
        if len(context) < 2:
            raise ValueError("a row's context must hold the prompt and the engine's first token")
        start = time.perf_counter()
        cache = RiftCache.for_config(self.model.config, self.layout, self.store_device, kinds=self.kinds)
        ids = torch.as_tensor(context[:-1], device=self.device)[None]
        pos = torch.arange(ids.shape[1], device=self.device)[None]
        chunked_forward(self.model, ids, pos, self.prefill_chunk, cache=cache, rift_observer=cache)
        cache.compress()
        seq = DraftSequence(cache, context, self.model.config.vocab_size, self.max_new_tokens)
        self.sequences.append(seq)
        self.stats.prefills += 1
        self.stats.prefill_seconds += time.perf_counter() - start
        return seq

    def _draft(self, rows: list[int], seqs, ks: dict[int, int]) -> dict[int, list[int]]:
        """Greedy drafts for ``rows``: their pending tokens but the last fed first (one forward per distinct count),
        then one batched forward per draft step over the rows still drafting."""
        # A row whose last drafts the engine has not verified yet (its context unchanged) proposes them again.
        todo = [i for i in rows if not seqs[i].drafts]
        early: dict[int, list[int]] = {}
        for i in todo:
            if len(seqs[i].pending) > 1:
                early.setdefault(len(seqs[i].pending) - 1, []).append(i)
        for idx in early.values():
            batched_forward(self.model, [seqs[i].cache for i in idx],
                            [seqs[i].pending[:-1].tolist() for i in idx], self.device, observe=True)
        feed = {i: [int(seqs[i].context[-1])] for i in todo}
        for step in range(max((ks[i] for i in todo), default=0)):
            idx = [i for i in todo if ks[i] > step]
            logits = batched_forward(self.model, [seqs[i].cache for i in idx], [feed[i] for i in idx], self.device,
                                     observe=True)
            ent = entropy(logits).tolist()
            tokens = logits.argmax(-1).tolist()
            for j, i in enumerate(idx):
                s = seqs[i]
                if step < ks[i] - 1:  # a hybrid draft's states after this token (a no-op for attention-only drafts)
                    s.cache.checkpoint()
                s.drafts.append(tokens[j])
                s.entropies.append(ent[j])
                feed[i] = [tokens[j]]
        return {i: list(seqs[i].drafts) for i in rows}
