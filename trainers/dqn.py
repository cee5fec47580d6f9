"""DQN training of a refresh controller (stable-baselines3), the second learner beside PPO (the kind and its export:
``rift_ada.controllers.dqn``).

Same protocol as PPO (``rift_ada.trainers.ppo``): the same RefreshEnvs, the same VecNormalize wrapper (observations
and rewards normalised; SB3's replay buffer stores raw transitions and normalises them when sampled), one process,
seeded. The exported controller is the Q-network (``q_net.q_net`` after the flattening features extractor) with the
observation statistics baked in; its argmax is ``DQN.predict(obs, deterministic=True)``.
"""

from __future__ import annotations

from rift_ada.trainers.ppo import learn, make_vec_env


def dqn_timesteps(timesteps: int, n_envs: int, train_freq: int = 1) -> int:
    """The environment steps DQN really takes for ``timesteps``: it collects ``train_freq`` steps of every env."""
    per = train_freq * n_envs
    return -(-timesteps // per) * per


def train_dqn(env_fns, timesteps: int, seed: int = 0, callback=None, net_arch=(32, 32), learning_rate: float = 5e-4,
              learning_starts: int = 100, target_update_interval: int = 256, exploration_fraction: float = 0.3,
              train_freq: int = 1, logger=None, progress: str | None = None, subproc: bool = False):
    """Train DQN on ``env_fns`` (thunks making RefreshEnvs), with a progress bar titled ``progress`` if given.
    Returns (model, vec_normalize). Settings are for short runs (a few thousand rounds): the target network follows
    every 256 steps (SB3's default, 10,000, would never update), epsilon falls from 1 to 0.05 over the first 30%."""
    from stable_baselines3 import DQN

    venv = make_vec_env(env_fns, subproc=subproc)
    venv.seed(seed)
    model = DQN("MlpPolicy", venv, learning_rate=learning_rate, buffer_size=max(timesteps, 1024),
                learning_starts=learning_starts, batch_size=64, gamma=0.99, train_freq=train_freq, gradient_steps=1,
                target_update_interval=target_update_interval, exploration_fraction=exploration_fraction,
                exploration_final_eps=0.05, seed=seed, device="cpu", verbose=0,
                policy_kwargs={"net_arch": list(net_arch)})
    return learn(model, venv, timesteps, dqn_timesteps(timesteps, len(env_fns), train_freq), callback, logger,
                 progress)
