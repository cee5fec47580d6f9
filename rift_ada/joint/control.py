"""Joint controllers: before each round, refresh or not and how many tokens to draft (0: one plain target step).

A joint controller's ``act(state) -> (refresh, draft_length)`` reads the decoder's published state
(``rift_ada.signals.DecoderState``); ``SpeculativeDecoder.rounds`` takes it as its ``decide`` (a refresh-only
controller's bool still works there unchanged). The learned one (:class:`JointPolicy`, exported from PPO by
``rift_ada.trainers.joint``) reads :func:`observe`: the refresh signals, the tokens since the last drafting round,
and what a draft token, a verified draft and a refresh cost at the current context in plain target steps (its
:class:`~rift_ada.joint.costs.RoundCosts`, stored in its file). The baselines are the same interface:
:class:`FixedJoint` (one (k, period) everywhere; k = 0 is speculate-never) and :class:`LengthTable` (k by context
length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from .. import signals
from ..files import read_torch
from ..refresh.mlp import normalize
from .costs import RoundCosts

DRAFT_LENGTHS = (0, 1, 2, 3, 5, 8, 11)  # the draft lengths a joint controller chooses from by default
IDLE_SCALE = 64.0  # tokens since the last drafting round, as the `idle` signal reads them (capped at 1)
# Beyond the refresh signals: tokens since the last drafting round (/ IDLE_SCALE); the mean acceptance of the drafting
# rounds acc_1..acc_H hold (1.0 if none: those signals pad missing rounds with 1.0) and their count / H; the
# acceptance over the whole generation so far (a long memory: plain steps add nothing to the short one); the target's
# recent confidence and the context's repeated suffix (signals.target_p_mean, suffix_match: what tells a plain stretch
# where drafting would pay, with no draft run to probe it); the costs.
NAMES = signals.NAMES + ("idle", "acc_seen", "drafted", "acc_long", "target_p", "match", "draft_cost", "verify_cost",
                         "refresh_cost")
KIND = "joint"
PREDICTS = ("gain", "tokens")  # what a learned joint controller's scores are (JointPolicy.predicts)


def actions(draft_lengths) -> list[tuple[bool, int]]:
    """Every (refresh, k) choice: each k without refreshing, and each k >= 1 after a refresh (a plain target step
    never reads the draft cache, so it never refreshes it)."""
    ks = sorted(set(int(k) for k in draft_lengths))
    if not ks or ks[0] < 0:
        raise ValueError(f"draft lengths must be integers >= 0, got {list(draft_lengths)}")
    return [(False, k) for k in ks] + [(True, k) for k in ks if k > 0]


def observe(state: signals.DecoderState, costs: RoundCosts, k_max: int, context: float | None = None) -> np.ndarray:
    """A joint controller's observation (:data:`NAMES`). ``context``: the context length the costs are read at (None:
    the state's prompt + generated tokens)."""
    ctx = state.prompt_tokens + state.generated if context is None else context
    seen = state.acceptance[:signals.HISTORY]
    extra = [min(state.since_draft / IDLE_SCALE, 1.0), sum(seen) / len(seen) if seen else 1.0,
             len(seen) / signals.HISTORY,
             state.accepted_total / state.drafted_total if state.drafted_total else 1.0, state.target_p,
             min(state.match, signals.MATCH_CAP) / signals.MATCH_CAP] + costs.features(ctx, k_max)
    return np.concatenate([signals.observe(state), np.asarray(extra, dtype=np.float32)]).astype(np.float32)


def price_vector(costs: RoundCosts, choices, context: float, missed: int = 0, plain: float | None = None,
                 left: int | None = None) -> np.ndarray:
    """Each (refresh, k) choice's modelled seconds at ``context`` (``missed``: plain-step tokens since the draft last
    ran), in plain target steps: what a round costs in the tokens greedy decoding would emit meanwhile. ``plain``: the
    plain step's seconds to count in (None: at ``context``); ``left``: the most drafts the generation has room for
    (None: no clipping)."""
    plain = costs.verify(1, context) if plain is None else plain
    ks = [k if left is None else max(min(k, left), 0) for _, k in choices]
    return np.asarray([costs.round_seconds(k, refresh and k > 0, context, missed) / plain
                       for (refresh, _), k in zip(choices, ks)])


class JointController:
    """The interface: ``act(state) -> (refresh, draft_length)``; ``k_max`` the largest draft length it asks for."""

    kind: ClassVar[str] = ""
    joint: ClassVar[bool] = True

    def act(self, state: signals.DecoderState) -> tuple[bool, int]:
        raise NotImplementedError

    @property
    def k_max(self) -> int:
        raise NotImplementedError

    def __call__(self, state: signals.DecoderState) -> tuple[bool, int]:
        return self.act(state)


@dataclass
class FixedJoint(JointController):
    """k draft tokens every round, refreshing once ``period`` tokens were generated since the last scoring (None:
    never). ``k = 0``: plain greedy decoding of the target (speculate-never)."""

    kind: ClassVar[str] = "fixed"
    k: int = 11
    period: int | None = None

    def act(self, state):
        return (self.k > 0 and self.period is not None and state.tokens_since_refresh >= self.period), self.k

    @property
    def k_max(self) -> int:
        return self.k

    def describe(self) -> str:
        return "speculate-never" if self.k == 0 else f"k={self.k}, period={self.period or 'never'}"


@dataclass
class LengthTable(JointController):
    """k by context length (the largest listed length not above the context gives it), refreshing every ``period``
    tokens: what a draft-length table keyed on context proposes (vLLM RFC #48627 / #54801)."""

    kind: ClassVar[str] = "length-table"
    lengths: tuple[int, ...] = (0,)
    ks: tuple[int, ...] = (11,)
    period: int | None = None

    def act(self, state):
        ctx = state.prompt_tokens + state.generated
        k = self.ks[max(int(np.searchsorted(self.lengths, ctx, side="right")) - 1, 0)]
        return (k > 0 and self.period is not None and state.tokens_since_refresh >= self.period), k

    @property
    def k_max(self) -> int:
        return max(self.ks)

    def describe(self) -> str:
        return ", ".join(f">={n}: k={k}" for n, k in zip(self.lengths, self.ks)) + f"; period={self.period or 'never'}"


@dataclass
class JointPolicy(JointController):
    """A learned joint controller: an MLP from :func:`observe` (normalised) to one score per action; the best is
    taken. ``family`` names how it learned ("ppo", ...); ``baselines`` records the fixed settings chosen beside it
    on the same training prompts (the bench runs them as its ``best_fixed`` and ``length_table`` rows).

    ``predicts``: what a score is. "gain": the action's time gain over greedy decoding, the costs it learned with
    baked in (they are also in its observation). "tokens": the tokens the action is expected to emit (its refresh's
    lasting acceptance counted), from which the action's price under ``prices`` (:func:`price_vector`) is subtracted
    when it decides: a machine whose plain step got cheaper against a verify moves its decisions with no retraining.
    ``prices``: the round costs of the machine it decides on (not stored; None: ``costs``; the bench measures them).
    """

    kind: ClassVar[str] = KIND
    net: nn.Sequential
    choices: list[tuple[bool, int]]
    costs: RoundCosts
    obs_mean: np.ndarray
    obs_var: np.ndarray
    family: str = "ppo"
    clip: float = 10.0
    epsilon: float = 1e-8
    baselines: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)  # the draft cache it learned with (``CacheLayout``'s fields)
    predicts: str = "gain"
    prices: RoundCosts | None = None

    def __post_init__(self):
        if self.predicts not in PREDICTS:
            raise ValueError(f"a joint controller's scores are one of {', '.join(PREDICTS)}, got {self.predicts!r}")

    @property
    def k_max(self) -> int:
        return max(k for _, k in self.choices)

    @torch.no_grad()
    def act_batch(self, observations: np.ndarray, prices: np.ndarray | None = None) -> np.ndarray:
        """The best action per observation; ``prices`` (observations x actions, :meth:`price`) are subtracted from
        the scores first."""
        x = normalize(np.asarray(observations, np.float64), self.obs_mean, self.obs_var, self.epsilon, self.clip)
        scores = self.net(torch.as_tensor(x, dtype=torch.float32)).numpy()
        return (scores if prices is None else scores - prices).argmax(-1)

    def price(self, state, context: float | None = None) -> np.ndarray:
        """What :meth:`act_batch` subtracts at ``state``: each action's price under :attr:`prices` if the scores are
        tokens, zeros if they are gains (priced when it learned)."""
        if self.predicts == "gain":
            return np.zeros(len(self.choices))
        ctx = state.prompt_tokens + state.generated if context is None else context
        return price_vector(self.prices or self.costs, self.choices, ctx, state.since_draft)

    def act(self, state, context: float | None = None):
        # A gain controller reads the deciding machine's costs as features; a tokens one reads its own (there they
        # only locate the context) and is priced by the deciding machine's.
        features = self.costs if self.predicts == "tokens" else (self.prices or self.costs)
        obs = observe(state, features, self.k_max, context)
        return self.choices[int(self.act_batch(obs[None], self.price(state, context)[None])[0])]

    def save(self, path) -> None:
        sizes = [m.in_features for m in self.net if isinstance(m, nn.Linear)] + [self.net[-1].out_features]
        acts = [type(m).__name__.lower() for m in self.net if not isinstance(m, nn.Linear)]
        torch.save({"kind": KIND, "family": self.family, "signals": list(NAMES), "sizes": sizes,
                    "activation": acts[0] if acts else "tanh", "state_dict": self.net.state_dict(),
                    "choices": [[bool(r), int(k)] for r, k in self.choices], "costs": self.costs.to_dict(),
                    "obs_mean": [float(x) for x in self.obs_mean], "obs_var": [float(x) for x in self.obs_var],
                    "clip": float(self.clip), "epsilon": float(self.epsilon), "baselines": self.baselines,
                    "layout": self.layout, "predicts": self.predicts}, path)

    def cache_layout(self):
        """The ``CacheLayout`` it learned with (a RIFT cache at its costs' budget if the file names none)."""
        from ..layout import CacheLayout

        if not self.layout:
            return CacheLayout("rift", budget=self.costs.budget)
        opts = {**self.layout, "scorer_options": tuple(tuple(x) for x in self.layout.get("scorer_options", ()))}
        return CacheLayout(**opts)

    @classmethod
    def from_dict(cls, d: dict, path) -> "JointPolicy":
        from ..refresh.mlp import load_weights, build_mlp

        if d.get("signals") != list(NAMES):
            raise ValueError(f"{path}: a joint controller for other signals ({d.get('signals')}); this version reads "
                             f"{len(NAMES)}: {', '.join(NAMES)}")
        choices = d.get("choices")
        sizes = d.get("sizes")
        if not (isinstance(choices, list) and choices and all(isinstance(c, list) and len(c) == 2 for c in choices)
                and isinstance(sizes, list) and len(sizes) >= 2 and sizes[0] == len(NAMES)
                and sizes[-1] == len(choices)):
            raise ValueError(f"{path}: 'sizes' must run from {len(NAMES)} signals to one output per entry of "
                             "'choices' [(refresh, k), ...]")
        if d.get("activation") not in ("tanh", "relu"):
            raise ValueError(f"{path}: 'activation' must be tanh or relu, got {d.get('activation')!r}")
        net = build_mlp(sizes, d["activation"])
        load_weights(net, d.get("state_dict"), path)
        mean, var = np.asarray(d.get("obs_mean"), np.float64), np.asarray(d.get("obs_var"), np.float64)
        if mean.shape != (len(NAMES),) or var.shape != (len(NAMES),) or not (np.isfinite(mean).all()
                                                                              and (var >= 0).all()):
            raise ValueError(f"{path}: 'obs_mean' and 'obs_var' must hold {len(NAMES)} finite numbers (var >= 0)")
        return cls(net.eval(), [(bool(r), int(k)) for r, k in choices],
                   RoundCosts.from_dict(d.get("costs") or {}, str(path)), mean, var, str(d.get("family", "ppo")),
                   float(d.get("clip", 10.0)), float(d.get("epsilon", 1e-8)), dict(d.get("baselines") or {}),
                   dict(d.get("layout") or {}), str(d.get("predicts", "gain")))

    @classmethod
    def load(cls, path: str | Path) -> "JointPolicy":
        d = read_torch(path, "a joint controller file")
        if not isinstance(d, dict) or d.get("kind") != KIND:
            raise ValueError(f"{path}: not a joint controller file (expected a dict with kind {KIND!r})")
        return cls.from_dict(d, path)


def baseline(spec: dict) -> JointController:
    """A baseline recorded in a joint controller's file (:attr:`JointPolicy.baselines`)."""
    if spec.get("kind") == FixedJoint.kind:
        return FixedJoint(int(spec["k"]), None if spec.get("period") is None else int(spec["period"]))
    if spec.get("kind") == LengthTable.kind:
        return LengthTable(tuple(int(x) for x in spec["lengths"]), tuple(int(x) for x in spec["ks"]),
                           None if spec.get("period") is None else int(spec["period"]))
    raise ValueError(f"unknown joint baseline {spec!r}")


def is_joint(controller) -> bool:
    return bool(getattr(controller, "joint", False))


def check_joint(controller: JointController, decoder) -> JointController:
    """``controller``, once it is known to fit ``decoder``: ValueError (one line) if it drafts more than the decoder's
    k; a learned one's costs warn once if they were measured elsewhere (another machine, budget or step)."""
    if controller.k_max > decoder.k:
        raise ValueError(f"the joint controller drafts up to {controller.k_max} tokens a round, more than the "
                         f"decoder's draft length k = {decoder.k}: raise it (--draft-length, rift_draft_length)")
    costs = getattr(controller, "costs", None)
    if costs is not None and not getattr(controller, "_checked", False):
        controller._checked = True
        steps = decoder.verify_step if decoder.verify_step == decoder.draft_step else None
        costs.check(decoder.layout.budget, steps, where=f"the joint {controller.family} controller")
    return controller
