"""Gymnasium environments: speculative decoding with a RIFT draft cache, one round per step.

``gymnasium.make("rift_ada/Refresh-v0", ...)`` works once this package is imported.
"""

import gymnasium as gym

from .refresh_env import RefreshEnv

ENV_ID = "rift_ada/Refresh-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="rift_ada.envs.refresh_env:RefreshEnv")

__all__ = ["ENV_ID", "RefreshEnv"]
