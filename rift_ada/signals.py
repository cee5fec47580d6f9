"""The refresh signals: one float32 vector per round, with fixed names, order and bounds.

Shared by the Gymnasium environment, every controller and the exported controller files, so a controller trained
in the environment reads the same vector the decoding loop gives it.

| name            | meaning                                                                 | bounds |
|-----------------|-------------------------------------------------------------------------|--------|
| `acc_1..acc_H`  | accepted drafts / k of the last H rounds, most recent first (1.0 before any round) | [0, 1] |
| `acc_mean`      | mean of the above                                                       | [0, 1] |
| `entropy_mean`  | draft entropy of the last round, mean over its draft steps, / ln(vocab) | [0, 1] |
| `entropy_max`   | the same, max over the round's draft steps                              | [0, 1] |
| `drift`         | query drift since the last scoring (1 - cosine of mean queries)         | [0, 1] |
| `runway`        | tokens the cache still holds right after the importance entry the draft reads most sharply now, / 64 | [0, 1] |
| `focus`         | the draft's largest attention weight on one importance entry now (its newest query)     | [0, 1] |
| `since_refresh` | generated tokens since the last scoring / 4096                          | [0, 1] |
| `position`      | generated tokens / max_new_tokens                                       | [0, 1] |
| `acc_fresh`     | accepted drafts / k over the first 2 rounds after the last scoring (the prefill's included) | [0, 1] |
| `acc_drop`      | acc_fresh - acc_mean: how far acceptance fell since the selection was fresh (>= 0)       | [0, 1] |
| `drift_rise`    | (drift - drift right after the last scoring) / (1 - that): drift beyond its fresh level  | [0, 1] |

The last three are relative to the same prompt's fresh selection: a code base where the draft accepts little even
when fresh, or a model whose drift never falls to 0 (heads with no queries count as cosine 0), shifts the raw
signals; the acceptance lost and the drift gained since the last scoring mean the same there as elsewhere.
Entropies are over a round's draft steps up to the first rejected one (those drafted on the emitted text).

The count behind `since_refresh` has one update rule, :func:`since_refresh_after` (the decoder's and the replay's),
and one inverse of its encoding, :func:`tokens_since_refresh` (what controllers compare with their periods and gaps).

`runway` and `focus` come from the draft's newest query over its active cache (``RiftCache.read_ahead``): one small
matmul per layer, no extra model forward. While a model copies from far back, the runway counts down one per generated
token to where the selection stops; acceptance only falls once it has run out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HISTORY = 4
RUNWAY_CAP = 64  # tokens; the snapkv scorer's default lookahead, so a fresh selection reads ~1.0
SINCE_SCALE = 4096.0  # a power of two: since_refresh * SINCE_SCALE is exactly the token count (up to the cap)
FRESH = 2  # rounds after a scoring that define its fresh acceptance (acc_fresh)
NAMES = tuple(f"acc_{i + 1}" for i in range(HISTORY)) + (
    "acc_mean", "entropy_mean", "entropy_max", "drift", "runway", "focus", "since_refresh", "position",
    "acc_fresh", "acc_drop", "drift_rise")
LOW = np.zeros(len(NAMES), dtype=np.float32)
HIGH = np.ones(len(NAMES), dtype=np.float32)


@dataclass(frozen=True)
class DecoderState:
    """What a refresh decision may look at between rounds: published by the decoder (``SpeculativeDecoder.state``),
    read by :func:`observe`."""

    generated: int  # tokens generated so far
    max_new_tokens: int
    rounds: int
    tokens_since_refresh: int
    drift: float  # query drift since the last scoring (computed once per round)
    acceptance: tuple[float, ...]  # accepted / k of the last HISTORY rounds, most recent first
    entropy_mean: float  # of the last round (0 before any round)
    entropy_max: float
    vocab_size: int
    runway: float = 0.0  # tokens (RiftCache.read_ahead), capped at RUNWAY_CAP
    focus: float = 0.0
    fresh: tuple[float, ...] = ()  # accepted / k of the first FRESH rounds after the last scoring (or the prefill)
    drift_floor: float = 0.0  # the drift published right after the last scoring's round (or the prefill)
    prompt_tokens: int = 0  # the prompt's length: with ``generated``, the context a round's costs depend on
    since_draft: int = 0  # tokens generated since the last round that drafted (plain target steps: k = 0)
    drafted_total: int = 0  # draft tokens proposed over the generation so far, and how many were accepted
    accepted_total: int = 0
    target_p: float = 1.0  # the target's mean probability of its last TARGET_WINDOW emitted tokens (target_p_mean)
    match: int = 0  # the context's repeated suffix, in tokens (suffix_match)


def index(name: str) -> int:
    if name not in NAMES:
        raise ValueError(f"unknown signal {name!r}; signals are: {', '.join(NAMES)}")
    return NAMES.index(name)


TARGET_WINDOW = 8  # emitted tokens the target_p signal averages over
MATCH_CAP = 16  # tokens: a longer repeated suffix reads as this one


def target_p_mean(p, generated: int) -> float:
    """The target's mean probability of emitted tokens ``generated - TARGET_WINDOW .. generated - 1`` (``p``: each
    emitted token's, under the sampling settings; 1 for greedy, as replay tables store it). Read off plain target steps
    too: where the target is sure of its next tokens a draft tends to agree, with no draft run to find out."""
    window = p[max(generated - TARGET_WINDOW, 0):generated]
    return float(sum(window) / len(window)) if len(window) else 1.0


def suffix_match(context: np.ndarray, cap: int = MATCH_CAP) -> int:
    """The length (up to ``cap``) of the longest suffix of ``context`` (token ids, prompt + emitted) that also occurs
    earlier in it, 0 if its last token never did. Text that repeats what came before is what a draft copies (the
    prompt-lookup signal); like ``target_p`` it costs no model forward, so a plain stretch keeps it current."""
    n = len(context)
    if n < 2:
        return 0
    ends = np.flatnonzero(context[:-1] == context[-1])  # earlier occurrences of the last token
    length = 0
    while len(ends) and length < cap:
        length += 1
        ends = ends[ends >= length]
        ends = ends[context[ends - length] == context[n - 1 - length]] if length < n else ends[:0]
    return length


def acceptance(accepted: int, draft_length: int) -> float:
    """A round's accepted share of its drafts, as ``acc_1..acc_H`` and ``acc_fresh`` read it. Only rounds that drafted
    enter them (a plain target step, k = 0, says nothing about the draft); 1.0 before any."""
    return accepted / draft_length if draft_length else 1.0


def recent_after(recent: tuple[float, ...], accepted: int, draft_length: int) -> tuple[float, ...]:
    """The ``acceptance`` of the last HISTORY rounds that drafted, most recent first, once a round is over: a drafting
    round's in front, a plain step (``draft_length`` 0) leaves it. The one update rule of the decoder and its replay
    (kept round by round: rescanning the rounds would cost the length of a long plain stretch every round)."""
    return (accepted / draft_length, *recent[:HISTORY - 1]) if draft_length else recent


def since_refresh_after(count: int, refreshed: bool, emitted: int) -> int:
    """``tokens_since_refresh`` once a round is over: ``count`` before it, restarted by a refresh (which runs before
    the round drafts), plus the round's ``emitted`` tokens. The one update rule, of the decoder and of its replay
    over a table (``rift_ada.replay.process``)."""
    return (0 if refreshed else count) + emitted


def tokens_since_refresh(observation) -> int:
    """Generated tokens since the last scoring, read back from an observation's ``since_refresh`` signal: the one
    inverse of its encoding (exact, since it divides the count by a power of two; counts past SINCE_SCALE read as
    SINCE_SCALE). Whole tokens, rounded down, so ``>= n`` means the same for any integer n on any input."""
    x = float(np.asarray(observation, dtype=np.float32).reshape(-1)[index("since_refresh")]) * SINCE_SCALE
    if not math.isfinite(x):
        raise ValueError(f"the since_refresh signal is {x / SINCE_SCALE}: not an observation of rift_ada.signals")
    return math.floor(x)


def observe(state: DecoderState) -> np.ndarray:
    """The signal vector of a decoder's published state (``SpeculativeDecoder.state``): a pure function of it."""
    acc = list(state.acceptance[:HISTORY]) + [1.0] * (HISTORY - len(state.acceptance[:HISTORY]))
    log_v = math.log(state.vocab_size)
    fresh = sum(state.fresh) / len(state.fresh) if state.fresh else 1.0
    floor = min(state.drift_floor, 1.0 - 1e-6)
    vec = acc + [
        sum(acc) / HISTORY,
        state.entropy_mean / log_v,
        state.entropy_max / log_v,
        state.drift,
        state.runway / RUNWAY_CAP,
        state.focus,
        state.tokens_since_refresh / SINCE_SCALE,
        state.generated / state.max_new_tokens,
        fresh,
        fresh - sum(acc) / HISTORY,
        (state.drift - floor) / (1.0 - floor),
    ]
    return np.clip(np.asarray(vec, dtype=np.float32), LOW, HIGH)
