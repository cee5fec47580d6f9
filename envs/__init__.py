"""Gymnasium environments: speculative decoding with a RIFT draft cache, one round per step: ``RefreshEnv`` runs
the models, ``ReplayEnv`` replays tables (``rift_ada.replay``) with the same observations, actions and rewards;
``JointReplayEnv`` replays them with the joint action (refresh and draft length, ``rift_ada.joint``) and the time
reward.

``gymnasium.make("rift_ada/Refresh-v0", ...)`` and ``gymnasium.make("rift_ada/Replay-v0", tables=...)`` work once
this package is imported.
"""

import gymnasium as gym

from .refresh_env import RefreshEnv
from .joint_env import JointRefreshEnv, JointReplayEnv
from .replay_env import ReplayEnv

ENV_ID = "rift_ada/Refresh-v0"
REPLAY_ENV_ID = "rift_ada/Replay-v0"
JOINT_ENV_ID = "rift_ada/JointReplay-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="rift_ada.envs.refresh_env:RefreshEnv")
if REPLAY_ENV_ID not in gym.registry:
    gym.register(id=REPLAY_ENV_ID, entry_point="rift_ada.envs.replay_env:ReplayEnv")
if JOINT_ENV_ID not in gym.registry:
    gym.register(id=JOINT_ENV_ID, entry_point="rift_ada.envs.joint_env:JointReplayEnv")

__all__ = ["ENV_ID", "JOINT_ENV_ID", "REPLAY_ENV_ID", "JointRefreshEnv", "JointReplayEnv", "RefreshEnv", "ReplayEnv"]
