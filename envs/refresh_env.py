"""RefreshEnv: speculative decoding with a RIFT draft cache as a Gymnasium environment.

One episode = one prompt's generation; one step = one speculation round. The action (``Discrete(2)``: 1 = refresh)
is applied before the round's drafting. The observation is the signal vector of ``rift_ada.signals``; the reward is
the round's accepted draft tokens minus ``lam * refresh_cost`` when it refreshed. Over an episode of fixed length the
accepted tokens sum to (tokens - rounds), so maximising them maximises acceptance length.
"""

from __future__ import annotations

from functools import lru_cache

import gymnasium as gym
import numpy as np

from rift_ada import signals
from rift_ada.data import build_tasks, encode_prompts
from rift_ada.metrics import acceptance_length
from rift_ada.policies import CachePolicy
from rift_ada.speculative import SpeculativeDecoder


@lru_cache(maxsize=8)
def _pair(target: str, drafter: str, device: str):
    from rift_ada.models import load_pair

    return load_pair(target, drafter, device=device)


class RefreshEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, target: str = "testbed", drafter: str = "self", budget: int = 512,
                 window_fraction: float = 0.5, scorer: str = "snapkv", obs_window: int = 32, draft_length: int = 11,
                 temperature: float = 0.0, max_new_tokens: int = 256, task: str = "low", input_tokens: int = 2048,
                 prompts: int = 8, prompt_seed: int = 0, split: str = "train", source_dir: str | None = None,
                 lam: float = 1.0, refresh_cost: float = 2.0, device: str = "cpu", decoder_seed: int = 0,
                 tasks=None, pair=None):
        super().__init__()
        if lam < 0 or refresh_cost < 0:
            raise ValueError("lam and refresh_cost must be >= 0")
        if prompts < 1:
            raise ValueError("prompts must be >= 1")
        pair = pair or _pair(target, drafter, device)  # pass a loaded ModelPair to share it between envs
        self.tokenizer = pair.tokenizer
        policy = CachePolicy("rift-ada", budget=budget, window_fraction=window_fraction, scorer=scorer,
                             obs_window=obs_window)
        self.decoder = SpeculativeDecoder(pair.target, None if pair.self_speculative else pair.draft, policy,
                                          draft_length=draft_length, temperature=temperature,
                                          eos_token_id=pair.tokenizer.eos_token_id, seed=decoder_seed)
        if tasks is None:
            tasks = build_tasks(pair.tokenizer, task, n=prompts, input_tokens=input_tokens, seed=prompt_seed,
                                source_dir=source_dir, split=None if source_dir else split)
        self.prompts = encode_prompts(pair.tokenizer, tasks)
        self.max_new_tokens, self.lam, self.refresh_cost = max_new_tokens, lam, refresh_cost
        self.decoder_seed = decoder_seed
        self.action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.spaces.Box(signals.LOW, signals.HIGH, dtype=np.float32)
        self.prompt_index = None

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
        return signals.observe(self.decoder), self._info(None)

    def step(self, action):
        if self.decoder.done:
            raise RuntimeError("the episode has ended: call reset()")
        if not self.action_space.contains(int(action)):
            raise ValueError(f"action must be 0 (keep) or 1 (refresh), got {action!r}")
        rec = self.decoder.step(bool(action))
        reward = rec.accepted - (self.lam * self.refresh_cost if rec.refreshed else 0.0)
        return signals.observe(self.decoder), float(reward), self.decoder.done, False, self._info(rec)

    def _info(self, rec) -> dict:
        rounds = self.decoder.result.rounds
        return {
            "accepted": rec.accepted if rec else 0,
            "refreshed": rec.refreshed if rec else False,
            "acceptance_length": acceptance_length(rounds),
            "refreshes": self.decoder.result.refreshes,
            "generated_tokens": len(self.decoder.result.tokens),
            "prompt_index": self.prompt_index,
        }
