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

The environment is handed a ready decoder (models, layout, k, temperature) and encoded prompts: whoever builds the
experiment builds them once, and the env only drives rounds.
"""

from __future__ import annotations

from typing import Sequence

import gymnasium as gym
import numpy as np

from rift_ada import signals
from rift_ada.costs import CostModel
from rift_ada.metrics import acceptance_length
from rift_ada.speculative import SpeculativeDecoder

REWARDS = ("tokens", "time")


def check_reward(lam: float, refresh_cost: float, reward: str, costs) -> None:
    """ValueError (one line) for reward settings an environment cannot use."""
    if lam < 0 or refresh_cost < 0:
        raise ValueError("lam and refresh_cost must be >= 0")
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {reward!r}")
    if reward == "time" and not isinstance(costs, CostModel):
        raise ValueError("reward='time' needs costs=CostModel(...) (measure them once with "
                         "rift_ada.costs.measure_costs)")


def round_reward(rec, kind: str, k: int, lam: float, refresh_cost: float, costs: CostModel | None) -> float:
    """A round's reward (module docstring), from its record (a ``RoundRecord`` or a replayed round): the one
    definition RefreshEnv and ReplayEnv share."""
    if kind == "time":
        plain = costs.round_seconds(k, False)
        return float(rec.emitted - costs.round_seconds(rec.draft_length, rec.refreshed, lam) / plain)
    return float(rec.accepted - (lam * refresh_cost if rec.refreshed else 0.0))


class RefreshEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256,
                 lam: float = 1.0, refresh_cost: float = 2.0, reward: str = "tokens", costs: CostModel | None = None):
        super().__init__()
        check_reward(lam, refresh_cost, reward, costs)
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
