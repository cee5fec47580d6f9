"""RefreshEnv: speculative decoding with a RIFT draft cache as a Gymnasium environment.

One episode = one prompt's generation; one step = one speculation round. The action (``Discrete(2)``: 1 = refresh)
is applied before the round's drafting. The observation is the signal vector of ``rift_ada.signals``. Two rewards:

- ``reward="tokens"`` (default): the round's accepted draft tokens minus ``lam * refresh_cost`` when it refreshed.
  Over an episode of fixed length the accepted tokens sum to (tokens - rounds), so maximising them maximises
  acceptance length.
- ``reward="time"``: the round's emitted tokens minus its modelled time in units of a plain round,
  ``emitted - (draft_length * draft_step_s + verify_s + lam * refresh_s * [refreshed]) / (k * draft_step_s +
  verify_s)``, with the measured ``costs`` (``rift_ada.costs.CostModel``; deterministic, no clock read while
  stepping). The episode sums to N - T / tau (N generated tokens, T their modelled seconds, tau one plain round's);
  N is fixed by max_new_tokens (unless EOS comes first), so maximising it minimises T, i.e. maximises the modelled
  tokens per second N / T, with refreshes charged their real cost at lam = 1 (other lambdas weight the refresh time
  to trace a tradeoff curve, as with the tokens reward). A full-k round without refresh earns its accepted drafts,
  as in the tokens reward.

The environment drives a ready decoder (models, layout, k, temperature) over encoded prompts: whoever builds the
experiment may hand it both. Without a decoder it builds one from plain keywords (``rift_ada.envs.settings.Setup``:
``target``, ``drafter``, ``budget``, ``refresh_grid``, ``draft_length``, ``temperature``, ``seed``, ``device``,
``dtype``; the models load once per process), and ``prompts`` may be a number of prompts to build (``task``,
``source_dir``, ``input_tokens``) or strings, so ``gymnasium.make("rift_ada/Refresh-v0")`` runs the testbed pair on
the default prompts: the same pair, cache and prompts as the default ``rift_ada/Replay-v0`` tables. ``costs``: a
``CostModel``, a dict or a JSON file of one.
"""

from __future__ import annotations

from typing import Sequence

import gymnasium as gym
import numpy as np

from rift_ada import signals
from rift_ada.costs import CostModel
from rift_ada.metrics import acceptance_length
from rift_ada.speculative import SpeculativeDecoder

from . import render
from .costs import cost_model
from .settings import Setup, take_keywords

REWARDS = ("tokens", "time")


def check_reward(lam: float, refresh_cost: float, reward: str, costs) -> None:
    """ValueError (one line) for reward settings an environment cannot use."""
    if lam < 0 or refresh_cost < 0:
        raise ValueError("lam and refresh_cost must be >= 0")
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {reward!r}")
    if reward == "time" and not isinstance(costs, CostModel):
        raise ValueError("reward='time' needs costs=CostModel(...) or a JSON file of one (measure them once with "
                         "rift_ada.costs.measure_costs)")


def round_reward(rec, kind: str, k: int, lam: float, refresh_cost: float, costs: CostModel | None) -> float:
    """A round's reward (module docstring), from its record (a ``RoundRecord`` or a replayed round): the one
    definition RefreshEnv and ReplayEnv share."""
    if kind == "time":
        plain = costs.round_seconds(k, False)
        return float(rec.emitted - costs.round_seconds(rec.draft_length, rec.refreshed, lam) / plain)
    return float(rec.accepted - (lam * refresh_cost if rec.refreshed else 0.0))


# The keywords that build the decoder and the prompts when no decoder is given (beside prompts and max_new_tokens).
BUILD_KEYWORDS = ("target", "drafter", "task", "source_dir", "input_tokens", "budget", "refresh_grid", "draft_length",
                  "temperature", "seed", "device", "dtype")


class RefreshEnv(gym.Env):
    metadata = {"render_modes": list(render.MODES), "render_fps": render.FPS}

    def __init__(self, decoder: SpeculativeDecoder | None = None, prompts: Sequence | int | None = None,
                 max_new_tokens: int = 256, lam: float = 1.0, refresh_cost: float = 2.0, reward: str = "tokens",
                 costs: CostModel | dict | str | None = None, render_mode: str | None = None, **build):
        super().__init__()
        take_keywords(type(self), build, BUILD_KEYWORDS)
        render.check_render_mode("RefreshEnv", render_mode)
        self.render_mode = render_mode
        costs = cost_model("RefreshEnv", costs)
        check_reward(lam, refresh_cost, reward, costs)
        if decoder is None:
            decoder, prompts, max_new_tokens = built(prompts, max_new_tokens, build)
        else:
            given = sorted(k for k, v in build.items() if v is not None)
            if given:
                raise ValueError(f"RefreshEnv: {', '.join(given)} only build{'s' if len(given) == 1 else ''} the "
                                 "decoder or the prompts when no decoder is given")
            if prompts is None or isinstance(prompts, int) or any(isinstance(p, str) for p in prompts):
                raise ValueError("RefreshEnv: with a decoder, give prompts as token ids (lists of ints): it has no "
                                 "tokenizer to build or encode them")
        if not prompts:
            raise ValueError("RefreshEnv needs at least one prompt")
        if not decoder.layout.refreshable:
            raise ValueError(f"the decoder's draft cache ({decoder.layout.describe()}) cannot refresh: give it a rift "
                             "layout with a backing store")
        self.decoder = decoder
        self.prompts = [list(p) for p in prompts]
        self.max_new_tokens, self.lam, self.refresh_cost = max_new_tokens, lam, refresh_cost
        self.reward_kind, self.costs = reward, costs
        self.action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.spaces.Box(signals.LOW, signals.HIGH, dtype=np.float32)
        self.prompt_index = None
        self._rounds, self._refresh = iter(()), False  # the decoder's loop over this episode's rounds, the action

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        i = options.get("prompt_index")
        if i is None:
            i = int(self.np_random.integers(len(self.prompts)))
        if not 0 <= i < len(self.prompts):
            raise ValueError(f"prompt_index {i} is out of range (0..{len(self.prompts) - 1})")
        self.prompt_index = i
        # Sampling randomness of the decoder follows the env's seed, so a seed fixes the whole trajectory.
        self.decoder.seed = int(self.np_random.integers(2**31))
        self.decoder.reset(self.prompts[i], self.max_new_tokens)
        # The decoder's own loop, each round refreshing as the action given to step() says.
        self._rounds = self.decoder.rounds(lambda state: self._refresh)
        return signals.observe(self.decoder.state), self._info(None)

    def step(self, action):
        if self.decoder.done:
            raise RuntimeError("the episode has ended: call reset()")
        if not self.action_space.contains(int(action)):
            raise ValueError(f"action must be 0 (keep) or 1 (refresh), got {action!r}")
        self._refresh = bool(action)
        rec = next(self._rounds)
        return signals.observe(self.decoder.state), self.reward(rec), self.decoder.done, False, self._info(rec)

    def render(self):
        if self.render_mode == "rgb_array":
            return render.strip_chart(self.decoder.result.rounds if self.prompt_index is not None else ())
        return None

    def reward(self, rec) -> float:
        """The reward of round ``rec`` (a ``RoundRecord``) under this env's reward and lambda (module docstring)."""
        return round_reward(rec, self.reward_kind, self.decoder.k, self.lam, self.refresh_cost, self.costs)

    def _info(self, rec) -> dict:
        rounds = self.decoder.result.rounds
        info = {
            "accepted": rec.accepted if rec else 0,
            "refreshed": rec.refreshed if rec else False,
            "acceptance_length": acceptance_length(rounds),
            "refreshes": self.decoder.result.refreshes,
            "generated_tokens": len(self.decoder.result.tokens),
            "prompt_index": self.prompt_index,
        }
        if self.costs is not None:  # the episode so far, modelled with the measured costs (lam aside)
            info["modelled_seconds"] = self.costs.seconds(rounds)
        return info


def built(prompts, max_new_tokens: int, build: dict):
    """A decoder and encoded prompts from plain keywords (``Setup``), and max_new_tokens checked."""
    setup = Setup.of("RefreshEnv", {**build, "prompts": prompts, "max_new_tokens": max_new_tokens})
    pair = setup.pair("RefreshEnv")
    return (SpeculativeDecoder.for_pair(pair, setup.layout(), setup.decoding()), setup.prompt_ids(pair.tokenizer),
            setup.max_new_tokens)
