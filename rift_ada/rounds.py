"""A speculative round's arithmetic as pure functions: tensors and counts in, tensors and counts out.

``SpeculativeDecoder.step`` (``rift_ada.speculative``) runs the models and keeps the caches; what it decides from
their logits is here, in the shape of gpt-fast's ``generate.py``: the sampling distribution, drawing a token, the
exact rejection rule, the draft-entropy signal, how many tokens a round drafts and emits. The replay tables
(``rift_ada.replay``) compute their p and q with the same :func:`sampling_probs`; the counts the signals read (a
round's acceptance, the tokens since the last refresh) are ``rift_ada.signals``'.

Randomness comes only from the ``generator`` passed in, one uniform draw per call of :func:`sample` and one per
examined draft in :func:`accept`, so a seed fixes every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """The sampling distribution over the last axis (temperature, then top-k, then top-p: transformers' order), or
    None for greedy (temperature 0). The decoder's and the replay tables' one definition."""
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


def sample(probs: torch.Tensor | None, logits: torch.Tensor, generator: torch.Generator) -> int:
    """A token from ``probs`` (one uniform draw from ``generator``), or the argmax of ``logits`` when greedy."""
    if probs is None:
        return int(logits.argmax())
    u = torch.rand(1, generator=generator, device=probs.device, dtype=torch.float64)
    return int(draw(probs, u))


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token (a 0-d long tensor, on the device: no host read) that the uniform ``u`` (shape (1,), float64) picks
    from ``probs`` (vocab,) by the inverse CDF. :func:`sample`'s draw, and the device round's (``draft_on_device``,
    :func:`accept_on_device`), inside a compiled graph too."""
    # Inverse CDF from one uniform draw: exact for a normalised distribution. torch.multinomial would normalise
    # whatever weights it gets and so hide an unnormalised input (e.g. a residual never divided by its sum).
    cdf = probs.double().cumsum(-1)
    i = torch.searchsorted(cdf, u.to(cdf.dtype), right=True)[0]  # first cdf > u: never a zero-probability token
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, vocab, -1).max()  # u beyond cdf[-1] by rounding: the last token with any mass
    return torch.where(i < probs.shape[-1], i, last)


def token_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_k: int = 0,
                top_p: float = 1.0) -> torch.Tensor:
    """Each token's probability under the sampling distribution of the logits that predicted it (1 for greedy): the
    ``p`` a replay table stores and the decoder's ``target_p`` signal reads, one definition."""
    probs = sampling_probs(logits, temperature, top_k, top_p)
    if probs is None:
        return torch.ones(tokens.shape[0], device=logits.device)
    return probs.gather(-1, tokens.to(probs.device)[:, None])[:, 0]


def accept(drafts: list[int], q_probs: list, t_logits: torch.Tensor, generator: torch.Generator,
           temperature: float, top_k: int = 0, top_p: float = 1.0) -> tuple[int, int]:
    """(accepted count, next token) of a round: ``drafts`` drawn from ``q_probs``, ``t_logits`` the target's
    logits at the 1 + len(drafts) verified positions. Greedy: the longest prefix equal to the target's argmax.
    Sampling (Leviathan et al.): accept x with probability min(1, p(x)/q(x)); at the first rejection resample from
    norm(max(p - q, 0)); after every draft is accepted take a bonus token from p."""
    if temperature == 0:
        target_tokens = t_logits.argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == target_tokens[n]:
            n += 1
        return n, target_tokens[n]
    for i, (x, q) in enumerate(zip(drafts, q_probs)):
        p = sampling_probs(t_logits[i], temperature, top_k, top_p)
        u = torch.rand((), generator=generator, device=generator.device)
        if u * q[x] <= p[x]:  # u < p/q without dividing by a tiny q
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        return i, sample(residual / total if total > 0 else p, t_logits[i], generator)
    bonus = t_logits[len(drafts)]
    return len(drafts), sample(sampling_probs(bonus, temperature, top_k, top_p), bonus, generator)


def accept_on_device(drafts: torch.Tensor, q_probs: torch.Tensor | None, t_logits: torch.Tensor, u: torch.Tensor | None,
                     temperature: float, top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept` as tensor code, nothing read back to the host: (accepted count, next token), 0-d long tensors.
    ``drafts`` (k,) long, ``q_probs`` (k, vocab) the distributions they were drawn from (None: greedy), ``t_logits``
    (k + 1, vocab), ``u`` (k + 1,) float64 uniforms: one per acceptance test, the last for the token drawn after them
    (None: greedy). The same rule: accept x_i while u_i q_i(x_i) <= p_i(x_i); at the first rejection draw from
    norm(max(p - q, 0)) (p where that is all zero), after k acceptances from p_k: q_k = 0 makes that the same formula.
    Every test is computed, and the count is the length of the accepted prefix, so the tests after the first rejection
    use uniforms that decide nothing: each decision still has its own independent uniform."""
    k = drafts.shape[0]
    if temperature == 0 or k == 0:
        if temperature:  # a plain target step: one draw from p
            return drafts.new_zeros(()), draw(sampling_probs(t_logits[0], temperature, top_k, top_p), u[:1])
        target = t_logits.argmax(-1)
        n = torch.cumprod((drafts == target[:k]).long(), 0).sum()
        return n, target[n]
    p = sampling_probs(t_logits, temperature, top_k, top_p)
    px = p[:k].gather(-1, drafts[:, None])[:, 0].double()
    qx = q_probs.gather(-1, drafts[:, None])[:, 0].double()
    n = torch.cumprod((u[:k] * qx <= px).long(), 0).sum()  # u < p/q without dividing by a tiny q
    q = torch.cat([q_probs, q_probs.new_zeros(1, q_probs.shape[-1])])
    p_n, q_n = p.index_select(0, n[None])[0], q.index_select(0, n[None])[0]
    residual = (p_n - q_n).clamp_min(0)
    total = residual.sum()
    dist = torch.where((n < k) & (total > 0), residual / torch.where(total > 0, total, 1.0), p_n)
    return n, draw(dist, u[k:k + 1])


def draft_count(draft_length: int, generated: int, max_new_tokens: int) -> int:
    """Draft tokens a round proposes: k, but never past max_new_tokens (the round emits one token more)."""
    return min(draft_length, max_new_tokens - generated - 1)


def cut_at_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """``tokens`` up to and including the first ``eos_token_id`` (all of them without one)."""
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[:tokens.index(eos_token_id) + 1]
    return tokens


# --- a round's outcome, one row's ---------------------------------------------------------------------------------------
@dataclass
class RoundOutcome:
    """What one row's round decided, as the host sees it: the drafts, how many were accepted, the token the target
    chose after them, the draft's entropy at each step, the target's probability of each token the round may emit
    (``drafts[:accepted]`` then ``next_token``; None when greedy: 1 each) and, from a device round, the cache signals
    of the state the round's decision read (None when they were read before). The host round builds it from host
    values; the device round packs it on the device (:func:`pack_outcome`), reads every row's at once, and unpacks
    it here (:func:`unpack_outcomes`): one layout, defined once."""

    drafts: list[int]
    accepted: int
    next_token: int
    entropies: list[float]
    emitted_p: list[float] | None = None
    signals: tuple[float, ...] | None = None

    @property
    def emitted(self) -> list[int]:
        """The tokens the round emits before any cut at EOS or max_new_tokens."""
        return self.drafts[:self.accepted] + [self.next_token]


def pack_outcome(drafts: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor, entropies: torch.Tensor,
                 emitted_p: torch.Tensor | None = None, signals: torch.Tensor | None = None) -> torch.Tensor:
    """A :class:`RoundOutcome` as one float64 tensor on the device, nothing read back: [drafts (k) | accepted |
    next token | entropies (k) | emitted_p (k + 1, sampling only) | signals (when given)]. Token ids are exact in
    float64 (below 2**53)."""
    parts = [drafts.double(), accepted.reshape(1).double(), next_token.reshape(1).double(), entropies.double()]
    if emitted_p is not None:
        parts.append(emitted_p.double())
    if signals is not None:
        parts.append(signals.double())
    return torch.cat(parts)


def outcome_width(k: int, sampled: bool, signals: int = 0) -> int:
    """How many values :func:`pack_outcome` writes for a round of ``k`` drafts."""
    return 2 * k + 2 + (k + 1 if sampled else 0) + signals


def unpack_outcomes(values: Sequence[float], ks: Sequence[int], sampled: bool, signals: Sequence[int]
                    ) -> list[RoundOutcome]:
    """The rows' outcomes from one read of their packed tensors laid end to end (row i: ``ks[i]`` drafts,
    ``signals[i]`` signal values)."""
    out, at = [], 0
    for k, n_sig in zip(ks, signals):
        v = values[at:at + outcome_width(k, sampled, n_sig)]
        at += len(v)
        p = 2 * k + 2
        out.append(RoundOutcome(drafts=[int(x) for x in v[:k]], accepted=int(v[k]), next_token=int(v[k + 1]),
                                entropies=list(v[k + 2:p]), emitted_p=list(v[p:p + k + 1]) if sampled else None,
                                signals=tuple(v[len(v) - n_sig:]) if n_sig else None))
    return out
