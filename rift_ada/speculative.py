"""Step-wise speculative decoding with a RIFT draft cache.

``SpeculativeDecoder.reset(prompt)`` prefills both models; ``step(refresh)`` runs one round and returns a
``RoundRecord``; ``decoder.state`` is a small read-only summary after each round (``rift_ada.signals.DecoderState``),
from which ``rift_ada.signals`` computes a controller's observation. The decoder never asks a controller: whoever
drives it does (``rift_ada.evaluate.decode``, the Gymnasium environment, the trainers), so there is exactly one
implementation of a round and the decoder knows nothing of controllers.

State between rounds: the target's cache holds every token except the last one emitted (``_t_pending``); the draft's
cache holds every token except ``_d_pending`` (one token, or two after a round in which all k drafts were accepted,
because the last draft token was never fed to the draft).

Hybrid models (linear-attention / Mamba layers, ``rift_ada.recurrent``) on either side: the draft checkpoints its
states after each draft forward and restores the one after the last kept token; the target's states are copied
before the verify forward, and a round that rejects a draft puts them back and feeds the kept tokens again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .architectures import layer_kinds
from .attention import check_observable
from .cache import RiftCache
from .layout import CacheLayout
from .models import check_vocab
from .recurrent import TargetStates
from .signals import FRESH, HISTORY, RUNWAY_CAP, DecoderState
from .static import StaticDraftStep, StaticKV, StaticVerify, check_static


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


class _Clock:
    """Wall time of a round's phases, synchronising the device first so GPU work is counted where it happens."""

    def __init__(self, sync):
        self.sync, self.t, self.seconds = sync, time.perf_counter(), {}

    def lap(self, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.seconds[f"{phase}_seconds"], self.t = now - self.t, now


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """The sampling distribution over the last axis (temperature, then top-k, then top-p: transformers' order), or
    None for greedy (temperature 0). The decoder's and the replay tables' (``rift_ada.replay``) one definition."""
    if temperature == 0:
        return None
    p = torch.softmax(logits.float() / temperature, -1)
    if 0 < top_k < p.shape[-1]:
        kth = p.topk(top_k, -1).values[..., -1:]
        p = p.masked_fill(p < kth, 0.0)  # ties with the k-th stay, as in transformers' TopKLogitsWarper
        p = p / p.sum(-1, keepdim=True)
    if top_p < 1:
        sorted_p, idx = p.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix reaching top_p
        p = p.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    return p


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats (temperature 1) over the last axis: the draft-entropy signal's per-step value."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def _entropy(logits: torch.Tensor) -> float:
    return float(entropy(logits))


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
                 verify_step: str = "model"):
        if not isinstance(draft_length, int) or draft_length < 1:
            raise ValueError(f"draft length k must be an integer >= 1, got {draft_length!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
        self.target = target
        self.draft = target if draft is None else draft
        self.self_speculative = draft is None or draft is target
        check_vocab(self.target, self.draft)
        layer_kinds(self.target.config)  # both caches must roll back exactly: layer kinds rift-ada knows only
        layer_kinds(self.draft.config)
        self.layout = layout or CacheLayout("full")
        self.k, self.temperature, self.top_p, self.top_k = draft_length, temperature, top_p, top_k
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.store_device = store_device
        self.device = self.target.device
        check_observable(self.draft)  # switches it to its observing attention; one one-token forward
        for name, value in (("draft_step", draft_step), ("verify_step", verify_step)):
            if value not in ("model", "static", "compiled"):
                raise ValueError(f"{name} must be 'model', 'static' or 'compiled', got {value!r}")
        self.draft_step, self.verify_step = draft_step, verify_step
        self._static = self._static_verify = None
        if draft_step != "model":
            check_static(self.draft)
            self._static = StaticDraftStep(self.draft, compile=draft_step == "compiled")
        if verify_step != "model":
            check_static(self.target, role="target")
            self._static_verify = StaticVerify(self.target, self.k + 1, compile=verify_step == "compiled")
        self.done = True

    # --- set-up ----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self, prompt_ids, max_new_tokens: int) -> None:
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        if ids.shape[1] < 1:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = min(getattr(m.config, "max_position_embeddings", 1 << 30) for m in (self.target, self.draft))
        if ids.shape[1] + max_new_tokens > limit:
            raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"models' context of {limit} tokens")
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)
        self.max_new_tokens = max_new_tokens
        self.prompt_len = ids.shape[1]
        t0 = time.perf_counter()
        pos = torch.arange(ids.shape[1], device=self.device)[None]
        self.tcache = DynamicCache(config=self.target.config)
        self._t_states = TargetStates(self.tcache)  # empty unless the target has linear-attention layers
        self.dcache = RiftCache.for_config(self.draft.config, self.layout, self.store_device)
        if self.self_speculative:
            # One prefill serves both caches: same model, same tokens; the draft cache copies the keys, values and
            # states.
            logits = self.target(ids, cache=self.tcache, position_ids=pos, rift_observer=self.dcache,
                                 logits_to_keep=1).logits
            self.dcache.load_from(self.tcache)
        else:
            logits = self.target(ids, cache=self.tcache, position_ids=pos, logits_to_keep=1).logits
            self.draft(ids, cache=self.dcache, position_ids=pos, rift_observer=self.dcache, logits_to_keep=1)
        # From now on sliding layers of the target keep every token fed since the last crop, so a rejection can be
        # rolled back once their window is full (each round's crop trims them back to the window); so do the conv
        # states of linear-attention layers. Activated after the prefill, which would otherwise record the whole
        # prompt's conv inputs.
        self.tcache.activate_past_recording()
        self.tcache.crop(0)
        self.dcache.compress()
        if self._static is not None and self.layout.tail_limit is None:
            # A cache that grows with the context (full, snapkv): room for the whole generation now, so its shape
            # holds for this prompt (a compiled step compiles once per prompt length; a RIFT budget's shape is the
            # same at every length).
            for layer in self.dcache.rift_layers:
                layer.reserve(self.prompt_len + max_new_tokens + self.k + 1)
        if self._static_verify is not None:
            # Room for every round: the last may start at prompt + max_new_tokens - 1 and writes a whole block.
            self.tcache = StaticKV(self.tcache, self.prompt_len + max_new_tokens + self.k + 1)
            self._t_states = TargetStates(self.tcache)
        first = self._sample(self._probs(logits[0, -1]), logits[0, -1])
        self._sync()
        self.result = DecodeResult(self.prompt_len, [first], prefill_seconds=time.perf_counter() - t0)
        self._t_pending, self._d_pending = [first], [first]
        self.tokens_since_refresh = 0
        self._fresh: list[float] = []  # accepted / k of the first rounds after the last scoring (signals.FRESH)
        self._drift_floor = None  # the drift published right after the last scoring
        self.done = first == self.eos_token_id or max_new_tokens <= 1
        self.state = self._state()

    # --- one round ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, refresh: bool = False) -> RoundRecord:
        """One round: [refresh] -> draft k -> verify -> accept -> roll back -> record."""
        if self.done:
            raise RuntimeError("generation is finished: call reset() with a new prompt")
        before, clock = self.state, _Clock(self._sync)
        if refresh:
            self.dcache.refresh()
        clock.lap("refresh")
        k = min(self.k, self.max_new_tokens - before.generated - 1)  # never draft past max_new_tokens
        drafts, q_probs, entropies = self._draft(k)
        active_bytes = self.dcache.active_bytes_by_kind()
        clock.lap("draft")
        if self._t_states:
            self._t_states.take()  # a hybrid target's states before the verify forward
        if self._static_verify is not None:
            t_logits = self._static_verify(self.tcache, self._t_pending + drafts)
        else:
            t_logits = self._forward(self.target, self.tcache, self._t_pending + drafts, all_logits=True)
        n, nxt = self._accept(drafts, q_probs, t_logits)
        clock.lap("verify")
        replayed = self._roll_back(k, n, drafts, nxt)
        clock.lap("rollback")
        new = self._emit(drafts[:n] + [nxt])
        # The steps up to the first rejected draft: their context is the emitted text (later steps condition on
        # the draft's own rejected tokens), so a replay table, which reads the emitted text, gives the same signal.
        entropies = entropies[:n + 1]
        record = RoundRecord(
            position=before.generated, accepted=n, emitted=len(new), draft_length=k, refreshed=bool(refresh),
            tokens_since_refresh=before.tokens_since_refresh, drift=before.drift, runway=before.runway,
            focus=before.focus,
            entropy_mean=sum(entropies) / len(entropies) if entropies else 0.0,
            entropy_max=max(entropies, default=0.0),
            active_kv_bytes=active_bytes["full"] + active_bytes["sliding"], active_kv_bytes_full=active_bytes["full"],
            active_kv_bytes_sliding=active_bytes["sliding"], state_bytes=active_bytes["state"],
            state_checkpoint_bytes=self.dcache.checkpoint_bytes(), target_replayed=replayed, **clock.seconds)
        self._publish(record)
        return record

    @classmethod
    def for_pair(cls, pair, layout: CacheLayout, decoding: "Decoding", draft=None,
                 store_device: str | None = None) -> "SpeculativeDecoder":
        """A decoder of ``pair`` (``rift_ada.models.ModelPair``) with ``layout`` and the ``decoding`` settings;
        ``draft`` replaces the pair's draft (e.g. one with a LoRA adapter)."""
        return cls(pair.target, pair.draft if draft is None else draft, layout, decoding.draft_length,
                   temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k,
                   eos_token_id=pair.tokenizer.eos_token_id, seed=decoding.seed, store_device=store_device,
                   draft_step=decoding.draft_step, verify_step=decoding.verify_step)

    # --- a round's bookkeeping ---------------------------------------------------------------------------------------
    def _draft(self, k: int) -> tuple[list[int], list, list[float]]:
        drafts, q_probs, entropies = [], [], []
        feed = self._d_pending
        for i in range(k):
            if self._static is not None:  # one token per step: one shape, so one compiled graph
                for token in feed:
                    logits = self._static(self.dcache, token, self.dcache.length)
            else:
                logits = self._forward(self.draft, self.dcache, feed, observe=True)
            if i < k - 1:  # a hybrid draft's states after this token, should the round keep no more (no-op else)
                self.dcache.checkpoint()
            q = self._probs(logits)
            drafts.append(self._sample(q, logits))
            q_probs.append(q)
            entropies.append(_entropy(logits))
            feed = drafts[-1:]
        return drafts, q_probs, entropies

    def _roll_back(self, k: int, n: int, drafts: list[int], nxt: int) -> bool:
        """The target fed 1 + k tokens and keeps 1 + n; the draft fed len(pending) + k - 1 tokens (the last draft
        token is never fed) and keeps len(pending) + n. True if the target had to replay its kept tokens."""
        replay = n < k and bool(self._t_states)
        if replay:
            self._replay_target(k, n, drafts)
        else:
            self.tcache.crop(-(k - n))
        fed_drafts = max(k - 1, 0)
        if n <= fed_drafts:
            self.dcache.rollback(fed_drafts - n)
            self._d_pending = [nxt] if k > 0 else self._d_pending + [nxt]
        else:  # all k accepted: the last draft token still has to be fed to the draft
            self.dcache.rollback(0)
            self._d_pending = [drafts[-1], nxt]
        self._t_pending = [nxt]
        return replay

    def _replay_target(self, k: int, n: int, drafts: list[int]) -> None:
        """A recurrent state cannot be cropped, and the verify forward's kernels give only its final value: put the
        target back where the round began and feed it the 1 + n kept tokens again (one more forward, over <= k + 1
        tokens). Its caches then hold exactly what feeding those tokens in one forward gives."""
        self.tcache.crop(-(k + 1))  # attention layers (and recorded conv states) back to the round's start
        self._t_states.restore()
        self._forward(self.target, self.tcache, self._t_pending + drafts[:n])
        self.tcache.crop(0)  # sliding layers and conv states back to their working size

    def _emit(self, new: list[int]) -> list[int]:
        if self.eos_token_id is not None and self.eos_token_id in new:
            new = new[: new.index(self.eos_token_id) + 1]
            self.done = True
        self.result.tokens.extend(new)
        self.done |= len(self.result.tokens) >= self.max_new_tokens
        return new

    def _publish(self, record: RoundRecord) -> None:
        self.result.rounds.append(record)
        self.result.decode_seconds += (record.refresh_seconds + record.draft_seconds + record.verify_seconds
                                       + record.rollback_seconds)
        self.tokens_since_refresh = (0 if record.refreshed else self.tokens_since_refresh) + record.emitted
        if record.refreshed:
            self._fresh, self._drift_floor = [], None
        if len(self._fresh) < FRESH:
            self._fresh.append(record.accepted / record.draft_length if record.draft_length else 1.0)
        self.state = self._state()

    def _state(self) -> DecoderState:
        rounds = self.result.rounds
        last = rounds[-1] if rounds else None
        runway, focus = self.dcache.read_ahead(RUNWAY_CAP)
        drift = self.dcache.query_drift()
        if self._drift_floor is None:  # the first state after a scoring (the prefill's, or a refreshing round's)
            self._drift_floor = drift
        return DecoderState(
            generated=len(self.result.tokens), max_new_tokens=self.max_new_tokens, rounds=len(rounds),
            tokens_since_refresh=self.tokens_since_refresh, drift=drift,
            acceptance=tuple(r.accepted / r.draft_length if r.draft_length else 1.0 for r in rounds[-HISTORY:][::-1]),
            entropy_mean=last.entropy_mean if last else 0.0, entropy_max=last.entropy_max if last else 0.0,
            vocab_size=self.draft.config.vocab_size, runway=runway, focus=focus, fresh=tuple(self._fresh),
            drift_floor=self._drift_floor)

    # --- pieces ----------------------------------------------------------------------------------------------------
    def _forward(self, model, cache, tokens: list[int], observe: bool = False, all_logits: bool = False):
        ids = torch.tensor([tokens], device=self.device)
        start = cache.get_seq_length()
        pos = torch.arange(start, start + len(tokens), device=self.device)[None]
        extra = {"rift_observer": cache} if observe else {}
        out = model(ids, cache=cache, position_ids=pos, logits_to_keep=0 if all_logits else 1, **extra).logits[0]
        return out if all_logits else out[-1]

    def _probs(self, logits: torch.Tensor) -> torch.Tensor | None:
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)

    def _sample(self, probs: torch.Tensor | None, logits: torch.Tensor) -> int:
        if probs is None:
            return int(logits.argmax())
        # Inverse CDF from one uniform draw: exact for a normalised distribution. torch.multinomial would normalise
        # whatever weights it gets and so hide an unnormalised input (e.g. a residual never divided by its sum).
        cdf = probs.double().cumsum(-1)
        u = torch.rand(1, generator=self.generator, device=probs.device, dtype=torch.float64)
        i = int(torch.searchsorted(cdf, u, right=True))  # first cdf > u: never a zero-probability token
        if i < cdf.shape[-1]:
            return i
        return int(probs.nonzero()[-1])  # u beyond cdf[-1] by rounding: the last token with any probability

    def _accept(self, drafts: list[int], q_probs: list, t_logits: torch.Tensor) -> tuple[int, int]:
        """(accepted count, next token). Greedy: longest prefix equal to the target's argmax. Sampling: accept x with
        probability min(1, p(x)/q(x)); at the first rejection resample from norm(max(p - q, 0)); after k acceptances
        take a bonus token from p."""
        if self.temperature == 0:
            target_tokens = t_logits.argmax(-1).tolist()
            n = 0
            while n < len(drafts) and drafts[n] == target_tokens[n]:
                n += 1
            return n, target_tokens[n]
        for i, (x, q) in enumerate(zip(drafts, q_probs)):
            p = self._probs(t_logits[i])
            u = torch.rand((), generator=self.generator, device=self.device)
            if u * q[x] <= p[x]:  # u < p/q without dividing by a tiny q
                continue
            residual = (p - q).clamp_min(0)
            total = residual.sum()
            return i, self._sample(residual / total if total > 0 else p, t_logits[i])
        return len(drafts), self._sample(self._probs(t_logits[len(drafts)]), t_logits[len(drafts)])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
