"""ReplayEnv: the refresh decision as a Gymnasium environment over replay tables (``rift_ada.replay``).

The same observation (``rift_ada.signals``), actions (``Discrete(2)``: 1 = refresh before the round) and rewards
(``tokens``, ``time`` with a measured ``CostModel``) as ``RefreshEnv``, so a controller trained here decides in the
decoding loop unchanged; but a step is arithmetic over a table (``rift_ada.replay.process.Replay``), not a round of
two models: tens of thousands of steps per second on one core instead of a few. One episode is one table (drawn
with the env's generator, or ``options={"table_index": i}``); with sampling tables the rejection rule's coin flips
come from the same generator, so a seed fixes the whole trajectory.

Every knob is a plain keyword, so ``gymnasium.make("rift_ada/Replay-v0", **kwargs)`` builds it. ``tables``: replay
tables, table files or a folder of them (``python -m rift_ada.replay build``, a main job's ``tables/``); None (the
default) replays the tables that the build keywords describe (``rift_ada.envs.settings.Setup``: ``target``,
``drafter``, ``prompts``, ``task``, ``source_dir``, ``input_tokens``, ``max_new_tokens``, ``budget``,
``refresh_grid``, ``temperature``, ``seed``, ``device``, ``dtype``), built on first use and cached
(``rift_ada.envs.tables``): with none given, the testbed pair on 3 training-split stdlib prompts (low, sort, high) of
1,024 tokens, 256 new tokens each, budget 256, grid 8, T = 1. ``costs``: a ``CostModel``, a dict or a JSON file of
one.
"""

from __future__ import annotations

from typing import Sequence

import gymnasium as gym
import numpy as np

from rift_ada import signals
from rift_ada.costs import CostModel
from rift_ada.replay.process import Replay
from rift_ada.replay.table import ReplayTable, check_same_settings

from . import render
from .costs import cost_model
from .refresh_env import check_reward, round_reward
from .settings import take_keywords
from .tables import BUILD_KEYWORDS, env_tables


class ReplayEnv(gym.Env):
    metadata = {"render_modes": list(render.MODES), "render_fps": render.FPS}

    def __init__(self, tables: Sequence[ReplayTable] | str | None = None, draft_length: int = 11, lam: float = 1.0,
                 refresh_cost: float = 2.0, reward: str = "tokens", costs: CostModel | dict | str | None = None,
                 shaping: bool = False, gamma: float = 0.99, render_mode: str | None = None, **build):
        super().__init__()
        take_keywords(type(self), build, BUILD_KEYWORDS)
        render.check_render_mode("ReplayEnv", render_mode)
        self.render_mode = render_mode
        costs = cost_model("ReplayEnv", costs)
        check_reward(lam, refresh_cost, reward, costs)
        # A config or a sweep may hand numpy integers; Replay takes plain ones.
        draft_length = int(draft_length) if isinstance(draft_length, np.integer) else draft_length
        tables = env_tables("ReplayEnv", tables, build)
        if not tables:
            raise ValueError("ReplayEnv needs at least one replay table")
        check_same_settings(tables)
        self.tables = list(tables)
        self.replays = [Replay(t, draft_length) for t in self.tables]
        self.k, self.lam, self.refresh_cost, self.reward_kind, self.costs = (draft_length, lam, refresh_cost, reward,
                                                                            costs)
        # Potential-based shaping (Ng, Harada and Russell, 1999) with the oracle's cost to go at this env's price:
        # the reward gains gamma * phi(s') - phi(s), phi = -(the oracle's expected cost from s). The optimal policy of
        # the full-state problem is unchanged; each step's reward says at once what its action cost in the oracle's
        # terms, instead of over the many rounds a refresh's effect lasts. The state (tokens, pending, row) is the
        # table's, not the observation: the learned policy still decides from the signals alone.
        self.shaping, self.gamma = shaping, gamma
        self.oracles = [self._oracle(t) for t in self.tables] if shaping else None
        self.action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.spaces.Box(signals.LOW, signals.HIGH, dtype=np.float32)
        self.replay: Replay | None = None
        self.table_index = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        i = (options or {}).get("table_index")
        if i is None:
            i = int(self.np_random.integers(len(self.tables)))
        if not 0 <= i < len(self.tables):
            raise ValueError(f"table_index {i} is out of range (0..{len(self.tables) - 1})")
        self.table_index, self.replay = i, self.replays[i]
        self.replay.reset(self.np_random)
        return signals.observe(self.replay.state), self._info(None)

    def step(self, action):
        if not self.action_space.contains(int(action)):
            raise ValueError(f"action must be 0 (keep) or 1 (refresh), got {action!r}")
        if self.replay is None or self.replay.done:
            raise RuntimeError("the episode has ended: call reset()")
        r = self.replay
        before = self._potential() if self.shaping else 0.0
        rec = r.step(bool(action))
        reward = round_reward(rec, self.reward_kind, self.k, self.lam, self.refresh_cost, self.costs)
        if self.shaping:
            reward += self.gamma * self._potential() - before
        return signals.observe(r.state), reward, r.done, False, self._info(rec)

    def render(self):
        if self.render_mode == "rgb_array":
            return render.strip_chart(self.replay.rounds if self.replay is not None else ())
        return None

    def _oracle(self, table):
        """The oracle whose cost is this env's reward, negated: per round 1 + the refresh price (tokens: lam x the
        refresh cost, in accepted tokens = rounds), or the round's modelled time over a plain round's (time)."""
        from rift_ada.replay.oracle import solve

        if self.reward_kind == "time":
            c, plain = self.costs, self.costs.round_seconds(self.k, False)
            return solve(table, self.k, self.lam * c.refresh_s / plain, c.verify_s / plain, c.draft_step_s / plain)
        return solve(table, self.k, self.lam * self.refresh_cost)

    def _potential(self) -> float:
        r = self.replay
        return -self.oracles[self.table_index].cost_to_go(r.g, r.pending, r.row)

    def _info(self, rec) -> dict:
        r = self.replay
        return {"accepted": rec.accepted if rec else 0, "refreshed": rec.refreshed if rec else False,
                "acceptance_length": r.acceptance_length(), "refreshes": r.refreshes, "generated_tokens": r.g,
                "table_index": self.table_index}
