"""JointReplayEnv: refresh or not *and* how many tokens to draft, as a Gymnasium environment over replay tables.

Beside ``ReplayEnv`` (refresh only, ``Discrete(2)``, unchanged): the action indexes ``rift_ada.joint.actions``, the
(refresh, k) choices (k = 0: one plain target step); the observation is ``rift_ada.joint.observe`` (the refresh
signals, the tokens since the last drafting round, and the round costs at the current context in plain target
steps). The reward is the time one: a round's emitted tokens less its modelled seconds in plain target steps at the
episode's context (``RoundCosts``), i.e. the tokens it gained over greedy decoding. An episode's tokens are fixed
(one table's continuation), so the return is that many tokens less the episode's time: the policy that maximises it
maximises tokens per second. Each episode is priced at its own table's prompt length: a table built at 1K does not
teach 4K (long prompts accept differently; docs/joint.md), so the tables should span the lengths the controller will
meet. ``JointRefreshEnv`` is the same environment over the real decoder (one round of both models per step), priced
by the same costs.

The observation is bounded: the signals in [0, 1], the costs (plain target steps) within their exact range over the
contexts an episode reaches (``RoundCosts.feature_range``: 1 .. the longest table's prompt and continuation).
``gymnasium.make("rift_ada/JointReplay-v0", **kwargs)`` takes ``ReplayEnv``'s ``tables`` and build keywords (none:
the testbed's default tables) and ``costs``: a ``RoundCosts``, a dict or a JSON file of one (a joint job's
``joint.json`` too); none: the testbed pair's measured costs (``envs/testbed_round_costs.json``: budget 256, static
steps, one thread of the machine named there).
"""

from __future__ import annotations

from typing import Sequence

import gymnasium as gym
import numpy as np

from rift_ada.joint.control import DRAFT_LENGTHS, NAMES, actions, observe
from rift_ada.joint.costs import RoundCosts
from rift_ada.joint.replay import priced_step
from rift_ada.replay.process import Replay
from rift_ada.replay.table import ReplayTable

from . import render
from .costs import round_costs
from .replay_env import check_same_settings
from .settings import take_keywords
from .tables import BUILD_KEYWORDS, env_tables


def observation_space(costs: RoundCosts, k_max: int, last_context: int) -> gym.spaces.Box:
    """The joint observation's Box: the signals in [0, 1], the costs within their range over contexts 1 ..
    ``last_context``."""
    n = len(NAMES) - 3  # the last three: the costs (rift_ada.joint.control.observe)
    lo, hi = costs.feature_range(k_max, last_context)
    return gym.spaces.Box(np.concatenate([np.zeros(n, np.float32), lo]), np.concatenate([np.ones(n, np.float32), hi]),
                          dtype=np.float32)


class JointReplayEnv(gym.Env):
    metadata = {"render_modes": list(render.MODES), "render_fps": render.FPS}

    def __init__(self, tables: Sequence[ReplayTable] | str | None = None, costs: RoundCosts | dict | str | None = None,
                 draft_lengths=DRAFT_LENGTHS, render_mode: str | None = None, **build):
        super().__init__()
        take_keywords(type(self), build, BUILD_KEYWORDS)
        render.check_render_mode("JointReplayEnv", render_mode)
        self.render_mode = render_mode
        costs = round_costs("JointReplayEnv", costs)
        self.choices = actions(draft_lengths)
        self.k_max = max(k for _, k in self.choices)
        if self.k_max < 1:
            raise ValueError("the draft lengths must include one >= 1")
        tables = env_tables("JointReplayEnv", tables, build)
        if not tables:
            raise ValueError("JointReplayEnv needs at least one replay table")
        check_same_settings(tables)
        self.tables, self.costs = list(tables), costs
        self.replays = [Replay(t, self.k_max) for t in self.tables]
        self.action_space = gym.spaces.Discrete(len(self.choices))
        self.last_context = max(t.prompt_len + len(t.tokens) for t in self.tables)
        self.observation_space = observation_space(costs, self.k_max, self.last_context)
        self.replay: Replay | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        i = options.get("table_index")
        i = int(self.np_random.integers(len(self.tables))) if i is None else i
        if not 0 <= i < len(self.tables):
            raise ValueError(f"table_index {i} is out of range (0..{len(self.tables) - 1})")
        # options["context"]: price the table at another prompt length (tests compare with a live decoder), within
        # the contexts the observation space covers
        context = options.get("context")
        if context is not None and not 1 <= context <= self.last_context - len(self.tables[i].tokens):
            raise ValueError(f"options['context'] must keep the episode within the contexts the observation space "
                             f"covers (1 .. {self.last_context} tokens), got {context}")
        self.table_index, self.replay = i, self.replays[i]
        self.replay.reset(self.np_random, prompt_tokens=context)
        self.context = self.replay.prompt_tokens
        self.plain_s = self.costs.verify(1, self.context)
        return self._observe(), {"context": self.context, "table_index": i}

    def step(self, action):
        if not self.action_space.contains(int(action)):
            raise ValueError(f"action must be in 0..{len(self.choices) - 1} (rift_ada.joint.actions), got {action!r}")
        if self.replay is None or self.replay.done:
            raise RuntimeError("the episode has ended: call reset()")
        refresh, k = self.choices[int(action)]
        rec, seconds = priced_step(self.replay, refresh, k, self.costs)
        return self._observe(), reward(rec, seconds, self.plain_s), self.replay.done, False, info(rec, seconds)

    def _observe(self) -> np.ndarray:
        return observe(self.replay.state, self.costs, self.k_max)

    def render(self):
        if self.render_mode == "rgb_array":
            return render.strip_chart(self.replay.rounds if self.replay is not None else ())
        return None


def reward(rec, seconds: float, plain_s: float) -> float:
    """A round's reward: its emitted tokens less its modelled seconds in plain target steps (the tokens it gained over
    greedy decoding)."""
    return float(rec.emitted - seconds / plain_s)


def info(rec, seconds: float) -> dict:
    return {"emitted": rec.emitted, "seconds": seconds, "draft_length": rec.draft_length, "refreshed": rec.refreshed,
            "accepted": rec.accepted}


class JointRefreshEnv(gym.Env):
    """``JointReplayEnv``'s actions, observation and reward over a ready decoder (its k at least the largest draft
    length) and encoded prompts: each step runs one round of both models. Its rounds are priced at their real
    context (prompt + generated tokens)."""

    metadata = {"render_modes": list(render.MODES), "render_fps": render.FPS}

    def __init__(self, decoder, prompts: Sequence[Sequence[int]], costs: RoundCosts, draft_lengths=DRAFT_LENGTHS,
                 max_new_tokens: int = 256, render_mode: str | None = None):
        super().__init__()
        render.check_render_mode("JointRefreshEnv", render_mode)
        self.render_mode, self._started = render_mode, False
        if not prompts:
            raise ValueError("JointRefreshEnv needs at least one prompt")
        self.choices = actions(draft_lengths)
        self.k_max = max(k for _, k in self.choices)
        if not 1 <= self.k_max <= decoder.k:
            raise ValueError(f"the draft lengths must include one >= 1 and stay <= the decoder's k ({decoder.k})")
        if not decoder.layout.refreshable:
            raise ValueError(f"the decoder's draft cache ({decoder.layout.describe()}) cannot refresh")
        self.decoder, self.prompts, self.costs = decoder, [list(p) for p in prompts], costs
        self.max_new_tokens = max_new_tokens
        self.action_space = gym.spaces.Discrete(len(self.choices))
        self.observation_space = observation_space(costs, self.k_max,
                                                   max(map(len, self.prompts)) + max_new_tokens)
        self._rounds, self._choice = iter(()), (False, 0)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        i = (options or {}).get("prompt_index")
        i = int(self.np_random.integers(len(self.prompts))) if i is None else i
        self.decoder.seed = int(self.np_random.integers(2**31))  # a seed fixes the trajectory
        self.decoder.reset(self.prompts[i], self.max_new_tokens)
        self._started = True
        self.plain_s = self.costs.verify(1, len(self.prompts[i]))
        self._rounds = self.decoder.rounds(lambda state: self._choice)
        return observe(self.decoder.state, self.costs, self.k_max), {"prompt_index": i}

    def step(self, action):
        if self.decoder.done:
            raise RuntimeError("the episode has ended: call reset()")
        if not self.action_space.contains(int(action)):
            raise ValueError(f"action must be in 0..{len(self.choices) - 1} (rift_ada.joint.actions), got {action!r}")
        self._choice = self.choices[int(action)]
        state = self.decoder.state
        rec = next(self._rounds)
        seconds = self.costs.round_seconds(rec.draft_length, rec.refreshed, state.prompt_tokens + state.generated,
                                           state.since_draft)
        obs = observe(self.decoder.state, self.costs, self.k_max)
        return obs, reward(rec, seconds, self.plain_s), self.decoder.done, False, info(rec, seconds)

    def render(self):
        if self.render_mode == "rgb_array":
            return render.strip_chart(self.decoder.result.rounds if self._started else ())
        return None
