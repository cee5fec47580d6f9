"""Step-wise speculative decoding with a RIFT draft cache.

``SpeculativeDecoder.reset(prompt)`` prefills both models; ``step(refresh)`` runs one round and returns a
``RoundRecord``; ``decoder.state`` is a small read-only summary after each round (``rift_ada.signals.DecoderState``),
from which ``rift_ada.signals`` computes a controller's observation. ``rounds(decide)`` is the decode loop: it steps
until the generation ends, asking ``decide(state)`` for each round's refresh. The decoder never asks a controller:
whoever drives the loop does (``rift_ada.evaluate.decode``, ``rift_ada.profiling``, the Gymnasium environment,
``rift_ada.hf.rift_generate``), so there is exactly one implementation of a round and one loop over them.

What a round decides from the logits (sampling, the rejection rule, entropy, the since-refresh count) is pure
arithmetic in ``rift_ada.rounds``; the static-shape draft step and verify live in ``rift_ada.static``; a hybrid
target's rollback (restore its states, replay the kept tokens) in ``rift_ada.recurrent.TargetStates``.

State between rounds: the target's cache holds every token except the last one emitted (``target_pending``); the draft's
cache holds every token except ``draft_pending`` (one token, or two after a round in which all k drafts were accepted,
because the last draft token was never fed to the draft).

Hybrid models (linear-attention / Mamba layers, ``rift_ada.recurrent``) on either side: the draft checkpoints its
states after each draft forward and restores the one after the last kept token; the target's states are copied
before the verify forward, and a round that rejects a draft puts them back and feeds the kept tokens again.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from transformers import DynamicCache

from .architectures import layer_kinds
from .attention import check_observable
from .cache import RiftCache
from .layout import CacheLayout
from .lora import AdapterSwitch, shares_weights
from .models import check_vocab
from .recurrent import TargetStates
from .rift_layer import ROUND_SLACK
from .rounds import (RoundOutcome, accept, accept_on_device, cut_at_eos, draft_count, entropy, pack_outcome, sample,
                     sampling_probs, token_probs, unpack_outcomes)
from .signals import (FRESH, RUNWAY_CAP, DecoderState, acceptance, recent_after, since_refresh_after, suffix_match,
                      target_p_mean)
from .static import static_steps


@dataclass
class RoundRecord:
    position: int  # tokens generated before this round
    accepted: int  # draft tokens accepted
    emitted: int  # tokens appended (accepted + 1, less any cut at EOS / max_new_tokens)
    draft_length: int  # draft tokens proposed this round
    refreshed: bool
    tokens_since_refresh: int  # generated tokens since the last scoring, when the decision was taken
    drift: float  # query drift since the last scoring, when the decision was taken
    runway: float  # read-ahead runway (tokens) and focus when the decision was taken (rift_ada.signals)
    focus: float
    entropy_mean: float  # draft entropy (nats, temperature 1) over this round's draft steps up to the first rejected
    entropy_max: float
    active_kv_bytes: int  # draft's active attention KV at its largest this round (round's tokens in flight)
    active_kv_bytes_full: int  # ... of it in full-attention (RIFT) layers
    active_kv_bytes_sliding: int  # ... of it in sliding-window layers
    draft_seconds: float
    verify_seconds: float
    refresh_seconds: float
    rollback_seconds: float = 0.0  # both caches back to the kept tokens (a hybrid target's replay included)
    state_bytes: int = 0  # draft's linear-attention conv + recurrent states (hybrid drafts; fixed in input length)
    state_checkpoint_bytes: int = 0  # ... and the copies its rollback keeps (up to k - 1 of them)
    target_replayed: bool = False  # a hybrid target fed the kept tokens again after a rejection


@dataclass(frozen=True)
class Decoding:
    """How a decoder drafts and samples (``rift_ada.cli.decoding_from_args`` reads them from the options)."""

    draft_length: int = 11  # k
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # 0 = off
    draft_step: str = "model"  # the draft's own forward, or rift_ada.static's step ("static", "compiled")
    verify_step: str = "model"  # the target's verify: its own forward, or on rift_ada.static's StaticKV


@dataclass
class DecodeResult:
    prompt_tokens: int
    tokens: list[int]
    rounds: list[RoundRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def refreshes(self) -> int:
        return sum(r.refreshed for r in self.rounds)


class Clock:
    """Wall time of a round's phases, synchronising the device first so GPU work is counted where it happens
    (``sync`` None: host time only, as a round that reads the device once must; the phases then say where the host
    waited, and only their sum is the round's time)."""

    def __init__(self, sync):
        self.sync, self.t, self.seconds = sync, time.perf_counter(), {}

    def lap(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.seconds[f"{phase}_seconds"], self.t = now - self.t, now


def check_decoding(draft_length: int, temperature: float, top_p: float, top_k: int, draft_step: str,
                   verify_step: str) -> None:
    """ValueError, in one line, for decoding settings no decoder can run."""
    if not isinstance(draft_length, int) or draft_length < 1:
        raise ValueError(f"draft length k must be an integer >= 1, got {draft_length!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    for name, value in (("draft_step", draft_step), ("verify_step", verify_step)):
        if value not in ("model", "static", "compiled"):
            raise ValueError(f"{name} must be 'model', 'static' or 'compiled', got {value!r}")


def check_models(target, draft) -> tuple[list, list]:
    """Refuse, in one line, a pair rift-ada cannot decode (UnsupportedModelError, ValueError); switches the draft to
    its observing attention (one one-token forward). Returns the (target's, draft's) ``layer_kinds``: computed here
    once, carried to the caches and steps built for the pair."""
    check_vocab(target, draft)
    kinds = layer_kinds(target.config), layer_kinds(draft.config)  # both caches must roll back exactly
    check_observable(draft, kinds[1])
    return kinds


def check_prompt(prompt_ids, max_new_tokens: int, models, device) -> torch.Tensor:
    """The prompt as a (1, length) tensor on ``device``; ValueError if it and ``max_new_tokens`` cannot be decoded
    within ``models``' context."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    if ids.shape[1] < 1:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = min(getattr(m.config, "max_position_embeddings", 1 << 30) for m in models)
    if ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"models' context of {limit} tokens")
    return ids


PREFILL_CHUNK = 8192  # tokens per prefill forward on CUDA (``prefill_chunk="auto"``)


def prefill_chunk_for(chunk, device) -> int:
    """Tokens per prefill forward: ``chunk`` as given (0: the whole prompt at once), or for "auto" PREFILL_CHUNK on
    CUDA, where one forward over a long prompt holds every layer's activations for all of it (a 128K prompt's MLP
    alone takes GBs), and the whole prompt on CPU (chunks change nothing there but the rounding)."""
    if chunk == "auto":
        return PREFILL_CHUNK if torch.device(device).type == "cuda" else 0
    if not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"prefill_chunk must be 'auto' or an integer >= 0 (0: the whole prompt), got {chunk!r}")
    return chunk


def chunked_forward(model, ids: torch.Tensor, pos: torch.Tensor, chunk: int, **kwargs):
    """The model's logits at the last token of ``ids``, fed ``chunk`` tokens per forward over the cache in kwargs."""
    step = chunk or ids.shape[1]
    for s in range(0, ids.shape[1], step):
        out = model(ids[:, s:s + step], position_ids=pos[:, s:s + step], logits_to_keep=1, **kwargs)
    return out.logits


def prefill(target, draft, ids: torch.Tensor, layout: CacheLayout, store_device=None, chunk: int = 0,
            draft_kinds=None, drafting=contextlib.nullcontext):
    """(target cache, draft cache, the target's logits at the prompt's last token): new caches holding the prompt
    ``ids``, the draft's compressed under ``layout``. ``draft=None``: self-speculation. ``chunk``: tokens per forward
    (0: the whole prompt in one). ``draft_kinds``: the drafting model's ``layer_kinds``, if computed already.
    ``drafting``: a context the draft's forward runs in (a self-drafter's adapter switched on)."""
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    tcache = DynamicCache(config=target.config)
    dcache = RiftCache.for_config((target if draft is None else draft).config, layout, store_device,
                                  kinds=draft_kinds)
    if draft is None:
        # One prefill serves both caches: same model, same tokens; the draft cache copies the keys, values and states.
        logits = chunked_forward(target, ids, pos, chunk, cache=tcache, rift_observer=dcache)
        dcache.load_from(tcache)
    else:
        logits = chunked_forward(target, ids, pos, chunk, cache=tcache)
        with drafting():
            chunked_forward(draft, ids, pos, chunk, cache=dcache, rift_observer=dcache)
    # From now on sliding layers of the target keep every token fed since the last crop, so a rejection can be
    # rolled back once their window is full (each round's crop trims them back to the window); so do the conv
    # states of linear-attention layers. Activated after the prefill, which would otherwise record the whole
    # prompt's conv inputs.
    tcache.activate_past_recording()
    tcache.crop(0)
    dcache.compress()
    return tcache, dcache, logits[0, -1]


CATCH_UP_CHUNK = 48  # tokens per forward when the draft catches up after plain steps (< ROUND_SLACK: no regrowth)


def forward(model, cache, tokens: list[int], device, observe: bool = False, all_logits: bool = False):
    """``model``'s logits after feeding ``tokens`` at their positions over ``cache``: at the last token, or at each
    (``all_logits``); ``observe`` records the queries of a RiftCache."""
    ids = torch.tensor([tokens], device=device)
    start = cache.get_seq_length()
    pos = torch.arange(start, start + len(tokens), device=device)[None]
    extra = {"rift_observer": cache} if observe else {}
    out = model(ids, cache=cache, position_ids=pos, logits_to_keep=0 if all_logits else 1, **extra).logits[0]
    return out if all_logits else out[-1]


def _kv_bytes(by_kind: dict[str, int]) -> dict[str, int]:
    """``RiftCache.active_bytes_by_kind`` as ``RoundRecord``'s fields."""
    return dict(active_kv_bytes=by_kind["full"] + by_kind["sliding"], active_kv_bytes_full=by_kind["full"],
                active_kv_bytes_sliding=by_kind["sliding"], state_bytes=by_kind["state"])


class SpeculativeDecoder:
    """Draft k tokens on a compressed cache, verify them with one target forward, keep the agreeing prefix.

    ``draft=None`` is self-speculation: the target drafts for itself on a compressed cache and verifies on a full one.
    ``temperature=0`` is greedy (output equals the target's own greedy decoding); otherwise drafts are accepted by the
    exact rejection rule (Leviathan et al.), so outputs follow the target's sampling distribution.

    Both models must be supported architectures (``rift_ada.architectures``): full-attention, sliding-window and
    linear-attention / Mamba layers, attention observable through AttentionInterface. Anything else is refused
    here, in one line (UnsupportedModelError), before any decoding.
    """

    def __init__(self, target, draft=None, layout: CacheLayout | None = None, draft_length: int = 11,
                 temperature: float = 0.0, top_p: float = 1.0, eos_token_id: int | None = None, seed: int = 0,
                 store_device: str | None = None, top_k: int = 0, draft_step: str = "model",
                 verify_step: str = "model", prefill_chunk: int | str = "auto"):
        check_decoding(draft_length, temperature, top_p, top_k, draft_step, verify_step)
        if draft_length + 1 > ROUND_SLACK and {draft_step, verify_step} != {"model"}:
            raise ValueError(f"the static steps draft at most {ROUND_SLACK - 1} tokens a round (k), got {draft_length}")
        self.target = target
        self.draft = target if draft is None else draft
        self.self_speculative = draft is None or draft is target
        # A self-drafter with a LoRA adapter (``rift_ada.lora.load_self_drafter``): one set of weights, the adapter
        # on in the draft passes alone, so every target forward (prefill, verify, replay) runs the base weights. It
        # prefills its own cache (the adapter changes the draft's keys and values), like an external draft.
        self.shared_weights = shares_weights(self.draft, target)
        self.drafting = contextlib.nullcontext
        if self.shared_weights:
            switch = AdapterSwitch(self.draft)
            switch.set(False)  # whatever state it came in: off at rest
            self.drafting = switch.on
        self.kinds = check_models(self.target, self.draft)  # (target's, draft's) layer kinds, computed once
        self.layout = layout or CacheLayout("full")
        self.k, self.temperature, self.top_p, self.top_k = draft_length, temperature, top_p, top_k
        self.eos_token_id, self.seed, self.store_device = eos_token_id, seed, store_device
        self.device = self.target.device
        self.draft_step, self.verify_step = draft_step, verify_step
        self.prefill_chunk = prefill_chunk_for(prefill_chunk, self.device)
        self._static, self._static_verify = static_steps(self.draft, self.target, draft_step, verify_step, self.k + 1,
                                                         self.sampling, kinds=self.kinds[::-1])
        # Both steps static: the round runs on the device and reads it once (``_on_device``).
        self.device_round = self._static is not None and self._static_verify is not None
        self.phase_sync = False  # device rounds: synchronise at each phase, to time them (costs a sync each)
        self.host_reads = 0  # device rounds: reads of the device's results (one per round)
        # Keep the last prompt's prefilled caches and start a generation of the same prompt from a copy of them: a
        # 32K prompt's prefill costs minutes on a CPU, and comparing schedules decodes one prompt many times.
        self.reuse_prefill = False
        self._prefilled: tuple | None = None  # (prompt ids, layout, (target cache, draft cache, logits))
        self.done = True

    @classmethod
    def for_pair(cls, pair, layout: CacheLayout, decoding: "Decoding", draft=None,
                 store_device: str | None = None) -> "SpeculativeDecoder":
        """A decoder of ``pair`` (``rift_ada.models.ModelPair``) with ``layout`` and the ``decoding`` settings;
        ``draft`` replaces the pair's draft (e.g. one with a LoRA adapter)."""
        return cls(pair.target, pair.draft if draft is None else draft, layout, decoding.draft_length,
                   temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k,
                   eos_token_id=pair.tokenizer.eos_token_id, seed=decoding.seed, store_device=store_device,
                   draft_step=decoding.draft_step, verify_step=decoding.verify_step)

    # --- a generation ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self, prompt_ids, max_new_tokens: int) -> None:
        """Start a generation of up to ``max_new_tokens``: prefill both caches and take the first token."""
        ids = check_prompt(prompt_ids, max_new_tokens, (self.target, self.draft), self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)
        self.max_new_tokens, self.prompt_len = max_new_tokens, ids.shape[1]
        t0 = time.perf_counter()
        self.tcache, self.dcache, logits = self._prefill(ids)
        room = self.prompt_len + max_new_tokens + self.k + 1  # the last round may start at prompt + max_new - 1
        if self._static is not None:
            self._static.prepare(self.dcache, room)
        if self._static_verify is not None:
            self.tcache = self._static_verify.cache(self.tcache, room)
        self.target_states = TargetStates(self.tcache)  # holds nothing unless the target has linear-attention layers
        first = sample(sampling_probs(logits, *self.sampling), logits, self.generator)
        self._sync()
        # prompt + emitted tokens, and the target's probability of each emitted one: the signals a plain stretch keeps
        # current (signals.target_p_mean, suffix_match)
        self._context = np.zeros(self.prompt_len + max_new_tokens + self.k + 2, dtype=np.int64)
        self._context[:self.prompt_len] = ids[0].cpu().numpy()
        self._context[self.prompt_len] = first
        self._p = token_probs(logits[None], torch.tensor([first]), *self.sampling).tolist()
        self.result = DecodeResult(self.prompt_len, [first], prefill_seconds=time.perf_counter() - t0)
        self.target_pending, self.draft_pending = [first], [first]
        self.tokens_since_refresh = 0
        self._fresh: list[float] = []  # accepted / k of the first rounds after the last scoring (signals.FRESH)
        self._since_draft = 0  # tokens emitted by plain target steps (k = 0) since the last drafting round
        self._recent: tuple[float, ...] = ()  # signals.recent_after
        self._drafted = self._accepted = 0  # draft tokens proposed and accepted so far
        self._drift_floor = None  # the drift published right after the last scoring (on the device until read)
        self.done = first == self.eos_token_id or max_new_tokens <= 1
        self.published_signals = self._cache_signals()
        self._state = None

    def _prefill(self, ids: torch.Tensor):
        """Both caches holding the prompt and the target's logits at its last token: prefilled, or with
        ``reuse_prefill`` copied from the last prefill of the same prompt under the same layout."""
        kept = self._prefilled
        if self.reuse_prefill and kept is not None and kept[1] == self.layout and torch.equal(kept[0], ids):
            return copy.deepcopy(kept[2])
        kept = self._prefilled = None  # another prompt's caches go before this prefill (at 16K, gigabytes)
        caches = prefill(self.target, None if self.self_speculative else self.draft, ids, self.layout,
                         self.store_device, self.prefill_chunk, draft_kinds=self.kinds[1], drafting=self.drafting)
        self._prefilled = (ids.clone(), self.layout, copy.deepcopy(caches)) if self.reuse_prefill else None
        return caches

    def rounds(self, decide: Callable[[DecoderState], bool | tuple[bool, int]] | None = None
               ) -> Iterator[RoundRecord]:
        """The decode loop: yield each round's record until the generation (``reset``) ends, each round as
        ``decide(state)`` says for the state published before it: a bool (refresh or not; None: never refresh), or
        (refresh, draft_length) from a joint controller (``rift_ada.joint``)."""
        while not self.done:
            choice = False if decide is None else decide(self.state)
            yield self.step(*choice) if isinstance(choice, tuple) else self.step(bool(choice))

    @torch.inference_mode()
    def step(self, refresh: bool = False, draft_length: int | None = None) -> RoundRecord:
        """One round: [refresh] -> draft k -> verify -> accept -> roll back -> record. ``draft_length``: this round's
        k, 0 to the decoder's ``draft_length`` (None: that); 0 is one plain target step (the draft catches up on the
        emitted tokens the next time it drafts)."""
        if self.done:
            raise RuntimeError("generation is finished: call reset() with a new prompt")
        if draft_length is not None and not (isinstance(draft_length, int) and 0 <= draft_length <= self.k):
            raise ValueError(f"a round's draft_length must be an integer in [0, {self.k}] (the decoder's "
                             f"draft_length), got {draft_length!r}")
        generated, since = len(self.result.tokens), self.tokens_since_refresh
        clock = Clock(self._sync if self.phase_sync or not self.device_round else None)
        if refresh:
            self.dcache.refresh()
        clock.lap("refresh")
        k = draft_count(self.k if draft_length is None else draft_length, generated, self.max_new_tokens)
        # The signals the decision read (the state published before this round), read back with the round's results.
        signals = self.published_signals if isinstance(self.published_signals, tuple) else None
        if self.device_round:
            outcome, active = self._on_device(k, clock)
            signals = signals or outcome.signals
        else:
            signals = signals or self.resolve_signals()
            outcome, active = self._on_host(k, clock)
        replayed = self.roll_back(k, outcome.accepted, outcome.drafts, outcome.next_token)
        clock.lap("rollback")
        return self.close_round(generated, since, refresh, k, outcome, signals, active, replayed, clock.seconds)

    def close_round(self, generated: int, since: int, refresh: bool, k: int, outcome: RoundOutcome, signals: tuple,
                     active: dict, replayed: bool, seconds: dict) -> RoundRecord:
        """After the rollback: append the round's tokens, record it and publish the next state. Shared by this
        decoder's round and a batch's (``rift_ada.batch``), which runs the forwards for many rows at once and then
        closes each row's round here."""
        n = outcome.accepted
        new = cut_at_eos(outcome.emitted, self.eos_token_id)
        at = self.prompt_len + len(self.result.tokens)
        self._context[at:at + len(new)] = new
        self._p += outcome.emitted_p[:len(new)] if outcome.emitted_p is not None else [1.0] * len(new)
        self.result.tokens.extend(new)
        self.done = new[-1] == self.eos_token_id or len(self.result.tokens) >= self.max_new_tokens
        # The steps up to the first rejected draft: their context is the emitted text (later steps condition on
        # the draft's own rejected tokens), so a replay table, which reads the emitted text, gives the same signal.
        entropies = outcome.entropies[:n + 1]
        runway, focus, drift = signals[:3]
        record = RoundRecord(
            position=generated, accepted=n, emitted=len(new), draft_length=k, refreshed=bool(refresh),
            tokens_since_refresh=since, drift=drift, runway=runway,
            focus=focus, entropy_mean=sum(entropies) / len(entropies) if entropies else 0.0,
            entropy_max=max(entropies, default=0.0), **_kv_bytes(active),
            state_checkpoint_bytes=self.dcache.checkpoint_bytes(), target_replayed=replayed, **seconds)
        self._publish(record)
        return record

    def _on_host(self, k: int, clock: Clock) -> tuple[RoundOutcome, dict]:
        """A round's draft, verify and acceptance with the host deciding each token: its outcome and the draft's
        active bytes."""
        with self.drafting():
            drafts, q_probs, entropies = self._draft(k)
        active = self.dcache.active_bytes_by_kind()
        clock.lap("draft")
        self.target_states.take()  # a hybrid target's states before the verify forward (none to copy otherwise)
        t_logits = self._verify(self.target_pending + drafts)
        n, nxt = accept(drafts, q_probs, t_logits, self.generator, *self.sampling)
        clock.lap("verify")
        return self.outcome(drafts, n, nxt, entropies, t_logits), active

    def outcome(self, drafts: list[int], n: int, nxt: int, entropies: list[float],
                t_logits: torch.Tensor) -> RoundOutcome:
        """A host round's :class:`RoundOutcome`; ``t_logits`` the target's at the verified positions (for the
        probability of each emitted token under the sampling settings, a replay table's ``p``)."""
        emitted = drafts[:n] + [nxt]
        p = None if self.temperature == 0 else token_probs(t_logits[:n + 1], torch.tensor(emitted),
                                                           *self.sampling).tolist()
        return RoundOutcome(drafts, n, nxt, entropies, p)

    def _on_device(self, k: int, clock: Clock) -> tuple[RoundOutcome, dict]:
        """A round's draft, verify and acceptance with every token kept on the device (both steps static): the draft
        step draws each draft from uniforms drawn once, the acceptance test runs as tensor code (``rounds.
        accept_on_device``), and the round's outcome comes back in one read (``host_reads``; ``rounds.pack_outcome``
        and ``unpack_outcomes``), with the previous state's cache signals when none was read yet."""
        feed = self.draft_pending
        if k:
            with self.drafting():
                if len(feed) > 2:
                    feed = self.catch_up(feed)
                drafts, q_probs, entropies = self._static.round(self.dcache, feed, k, self.generator)
        else:
            drafts = torch.zeros(0, dtype=torch.long, device=self.device)
            q_probs, entropies = None, torch.zeros(0, device=self.device)
        active = self.dcache.active_bytes_by_kind()
        clock.lap("draft")
        t_logits = self._static_verify.on_device(self.tcache, self.target_pending[0], drafts)
        packed = self.device_outcome(drafts, q_probs, entropies, t_logits)
        values = packed.tolist()  # the round's one read of the device
        self.host_reads += 1
        clock.lap("verify")
        (outcome,) = unpack_outcomes(values, [k], self.temperature > 0, [self.unread_signals()])
        self.take_signals(outcome)
        return outcome, active

    def device_outcome(self, drafts: torch.Tensor, q_probs: torch.Tensor | None, entropies: torch.Tensor,
                       t_logits: torch.Tensor) -> torch.Tensor:
        """A device round's acceptance (``rounds.accept_on_device``, its uniforms from this decoder's generator) and
        its outcome packed on the device (``rounds.pack_outcome``), with the published cache signals when none were
        read yet; nothing read back. This decoder's round and a batch's (every row's, read at once) both end here."""
        k = drafts.shape[0]
        sampled = self.temperature > 0
        u = torch.rand(k + 1, generator=self.generator, device=self.device, dtype=torch.float64) if sampled else None
        n, nxt = accept_on_device(drafts, q_probs, t_logits[:k + 1], u, *self.sampling)
        emitted_p = None
        if sampled:  # the target's probability of each token the round may emit: drafts[:n], then nxt
            emit = torch.where(torch.arange(k + 1, device=self.device) < n, torch.cat([drafts, nxt[None]]), nxt)
            emitted_p = token_probs(t_logits[:k + 1], emit, *self.sampling)
        signals = self.published_signals if self.unread_signals() else None
        return pack_outcome(drafts, n, nxt, entropies, emitted_p, signals)

    def unread_signals(self) -> int:
        """How many signal values a device round packs: the published cache signals (4) until someone read them."""
        return 0 if isinstance(self.published_signals, tuple) else 4

    def take_signals(self, outcome: RoundOutcome) -> None:
        """Keep the signals a device round read back with its outcome."""
        if outcome.signals is not None:
            self.published_signals = outcome.signals

    # --- a round's pieces --------------------------------------------------------------------------------------------
    def _draft(self, k: int) -> tuple[list[int], list, list[float]]:
        """k draft tokens, the distributions they were drawn from, and the draft's entropy at each step."""
        drafts, q_probs, entropies = [], [], []
        feed = self.draft_pending
        if k and self._static is not None and len(feed) > 2:
            feed = self.catch_up(feed)
        for i in range(k):
            logits = (forward(self.draft, self.dcache, feed, self.device, observe=True) if self._static is None
                      else self._static.feed(self.dcache, feed))
            if i < k - 1:  # a hybrid draft's states after this token, should the round keep no more (no-op else)
                self.dcache.checkpoint()
            q = sampling_probs(logits, *self.sampling)
            drafts.append(sample(q, logits, self.generator))
            q_probs.append(q)
            entropies.append(float(entropy(logits)))
            feed = drafts[-1:]
        return drafts, q_probs, entropies

    def catch_up(self, feed: list[int]) -> list[int]:
        """Feed the draft all but the last of ``feed`` (the tokens plain target steps emitted since it last drafted)
        in chunks of CATCH_UP_CHUNK, one forward each: the static step takes one token per call, and a stretch of
        plain steps would cost that many draft steps. Each query sees what a step would (``RiftLayer.window_mask``);
        the tail is evicted back to the window between chunks, so the active buffers never outgrow their capacity (a
        compiled step's one shape). Returns what is left to feed: the last token."""
        for i in range(0, len(feed) - 1, CATCH_UP_CHUNK):
            forward(self.draft, self.dcache, feed[i:min(i + CATCH_UP_CHUNK, len(feed) - 1)], self.device,
                    observe=True)
            self.dcache.rollback(0)
        for layer in self.dcache.rift_layers:  # it fed the positions that followed: the log stays consecutive
            layer.log.end = layer.length
        return feed[-1:]

    def _verify(self, tokens: list[int]) -> torch.Tensor:
        """The target's logits at each of ``tokens`` (the pending token and the drafts), one forward."""
        if self._static_verify is not None:
            return self._static_verify(self.tcache, tokens)
        return forward(self.target, self.tcache, tokens, self.device, all_logits=True)

    def roll_back(self, k: int, n: int, drafts: list[int], nxt: int) -> bool:
        """The target fed 1 + k tokens and keeps 1 + n; the draft fed len(pending) + k - 1 tokens (the last draft
        token is never fed) and keeps len(pending) + n. True if the target had to replay its kept tokens."""
        replayed = self.target_states.roll_back(1 + k, self.target_pending + drafts[:n],
                                            lambda kept: forward(self.target, self.tcache, kept, self.device))
        fed_drafts = max(k - 1, 0)
        if n <= fed_drafts:
            self.dcache.rollback(fed_drafts - n)
            self.draft_pending = [nxt] if k > 0 else self.draft_pending + [nxt]
        else:  # all k accepted: the last draft token still has to be fed to the draft
            self.dcache.rollback(0)
            self.draft_pending = [drafts[-1], nxt]
        self.target_pending = [nxt]
        return replayed

    def _publish(self, record: RoundRecord) -> None:
        """Keep the round's record and publish the state the next round's decision reads."""
        self.result.rounds.append(record)
        self.result.decode_seconds += (record.refresh_seconds + record.draft_seconds + record.verify_seconds
                                       + record.rollback_seconds)
        self.tokens_since_refresh = since_refresh_after(self.tokens_since_refresh, record.refreshed, record.emitted)
        if record.refreshed:
            self._fresh, self._drift_floor = [], None
        if len(self._fresh) < FRESH and record.draft_length:
            self._fresh.append(acceptance(record.accepted, record.draft_length))
        self._since_draft = 0 if record.draft_length else self._since_draft + record.emitted
        self._recent = recent_after(self._recent, record.accepted, record.draft_length)
        self._drafted, self._accepted = self._drafted + record.draft_length, self._accepted + record.accepted
        # A plain target step feeds the draft nothing: its cache, hence its read-ahead and drift, are as they were.
        if record.draft_length or record.refreshed:
            self.published_signals = self._cache_signals()
        self._state = None

    def _cache_signals(self) -> torch.Tensor:
        """The signals read off the draft's cache (runway, focus, drift, the drift right after the last scoring), as
        one tensor on the device: computed now, read back only when someone reads them (``state``, or the next
        round's one read)."""
        drift = self.dcache.query_drift_tensor().reshape(1).float()
        if self._drift_floor is None:  # the first state after a scoring (the prefill's, or a refreshing round's)
            self._drift_floor = drift
        return torch.cat([self.dcache.read_ahead_tensor(RUNWAY_CAP).float(), drift, self._drift_floor])

    def resolve_signals(self) -> tuple[float, ...]:
        if not isinstance(self.published_signals, tuple):
            self.published_signals = tuple(self.published_signals.tolist())
        return self.published_signals

    @property
    def state(self) -> DecoderState:
        """What a decision before the coming round may look at (``rift_ada.signals``). Built when first read after a
        round: the cache's signals are then read back from the device (a decision that reads none costs no read)."""
        if self._state is None:
            self._state = self._build_state()
        return self._state

    def _build_state(self) -> DecoderState:
        rounds = self.result.rounds
        last = rounds[-1] if rounds else None
        runway, focus, drift, floor = self.resolve_signals()
        return DecoderState(
            generated=len(self.result.tokens), max_new_tokens=self.max_new_tokens, rounds=len(rounds),
            tokens_since_refresh=self.tokens_since_refresh, drift=drift,
            acceptance=self._recent,
            entropy_mean=last.entropy_mean if last else 0.0, entropy_max=last.entropy_max if last else 0.0,
            vocab_size=self.draft.config.vocab_size, runway=runway, focus=focus, fresh=tuple(self._fresh),
            drift_floor=floor, prompt_tokens=self.prompt_len, since_draft=self._since_draft,
            drafted_total=self._drafted, accepted_total=self._accepted,
            target_p=target_p_mean(self._p, len(self.result.tokens)),
            match=suffix_match(self._context[:self.prompt_len + len(self.result.tokens)]))

    # --- settings ----------------------------------------------------------------------------------------------------
    @property
    def sampling(self) -> tuple[float, int, float]:
        """(temperature, top_k, top_p): the arguments of ``rift_ada.rounds.sampling_probs`` and ``accept``."""
        return self.temperature, self.top_k, self.top_p

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
