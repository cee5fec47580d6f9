"""Gymnasium environments: speculative decoding with a RIFT draft cache, one round per step: ``RefreshEnv`` runs
the models, ``ReplayEnv`` replays tables (``rift_ada.replay``) with the same observations, actions and rewards;
``JointReplayEnv`` replays them with the joint action (refresh and draft length, ``rift_ada.joint``) and the time
reward.

Once this package is imported, each id makes a working environment with no arguments, on the built-in testbed
(``gymnasium.make("rift_ada/Replay-v0")``; without the import, ``"rift_ada.envs:rift_ada/Replay-v0"``), and every
knob is a plain keyword (``gymnasium.make(id, **kwargs)``, ``gymnasium.make_vec``, SB3's ``make_vec_env``):

- ``rift_ada/Refresh-v0``: ``RefreshEnv``, the testbed pair decoding the default prompts (``settings.py``);
- ``rift_ada/Replay-v0``: ``ReplayEnv`` over the default replay tables, built on first use (about a minute) and
  cached (``tables.py``);
- ``rift_ada/JointReplay-v0``: ``JointReplayEnv`` over the same tables, priced by the testbed pair's measured round
  costs (``costs.py``).

Passing a decoder, tables or cost objects keeps working for code that has them.
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
