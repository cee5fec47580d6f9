"""PPO training of a refresh controller (stable-baselines3), and the export of an SB3 MLP to a torch-only controller
(``export_mlp``; the kinds themselves: ``rift_ada.controllers.ppo`` / ``.dqn``)."""

from __future__ import annotations

import numpy as np
import torch

from rift_ada.refresh.mlp import MLPController, build_mlp


def make_vec_env(env_fns, norm_reward: bool = True, subproc: bool = False):
    """The envs (``rift_ada.envs.vec.make_vec_env``: in this process, or one worker each with ``subproc``) under
    VecNormalize (observations and rewards)."""
    from stable_baselines3.common.vec_env import VecNormalize

    from rift_ada.envs.vec import make_vec_env as vec_env

    return VecNormalize(vec_env(env_fns, subproc=subproc), norm_obs=True, norm_reward=norm_reward, clip_obs=10.0)


def rollout_timesteps(timesteps: int, n_envs: int, n_steps: int = 128) -> int:
    """The environment steps PPO really takes for ``timesteps``: it learns in whole rollouts of n_steps x n_envs."""
    per = n_steps * n_envs
    return -(-timesteps // per) * per


def progress_callback(total: int, desc: str):
    """A tqdm bar over PPO's environment steps (SB3's own bar needs rich)."""
    from stable_baselines3.common.callbacks import BaseCallback
    from tqdm.auto import tqdm

    class Progress(BaseCallback):
        def _on_training_start(self):
            self.bar = tqdm(total=total, desc=desc)

        def _on_step(self):
            self.bar.update(self.training_env.num_envs)  # callbacks count vector steps
            return True

        def _on_training_end(self):
            self.bar.close()

    return Progress()


def train_ppo(env_fns, timesteps: int, seed: int = 0, callback=None, net_arch=(32, 32), n_steps: int = 128,
              learning_rate: float = 3e-4, ent_coef: float = 0.01, logger=None, progress: str | None = None,
              subproc: bool = False, demonstrations=None, value_warmup: int = 0, gamma: float = 0.99):
    """Train PPO on ``env_fns`` (thunks making RefreshEnvs or ReplayEnvs; RefreshEnvSpecs with ``subproc``), with a
    progress bar titled ``progress`` if given. ``demonstrations`` (observations, actions, weights): the policy first
    clones them (:func:`clone`), then, for ``value_warmup`` steps, only the value function learns (the policy
    frozen), then PPO improves on the clone: without the warm-up the first updates' advantages come from an untrained
    critic and can undo the clone (leave-one-code-base-out on an earlier job's tables: 12% refresh savings against
    periodic without, 27% with; on the final tables 45% without, 40% with: docs/rift-ada.md). Returns (model, vec_normalize). Deterministic given
    ``seed`` (SB3 seeds python, numpy, torch and the envs), in one process or several."""
    from stable_baselines3 import PPO

    venv = make_vec_env(env_fns, subproc=subproc)
    venv.seed(seed)
    model = PPO("MlpPolicy", venv, n_steps=n_steps, batch_size=64, n_epochs=10, learning_rate=learning_rate,
                gamma=gamma, ent_coef=ent_coef, seed=seed, device="cpu", verbose=0,
                policy_kwargs={"net_arch": list(net_arch)})
    if demonstrations is not None:
        clone(model, venv, *demonstrations, seed=seed)
    warm = rollout_timesteps(value_warmup, len(env_fns), n_steps) if value_warmup > 0 else 0
    if warm:
        _warm_value(model, venv, warm, callback, logger, progress and f"{progress} (value warm-up)")
    return learn(model, venv, timesteps, rollout_timesteps(timesteps, len(env_fns), n_steps), callback, logger,
                 progress, reset=not warm)


def _warm_value(model, venv, timesteps: int, callback, logger, progress):
    """PPO's updates with the policy's own parameters frozen: the critic learns the clone's returns first."""
    policy = model.policy
    frozen = list(policy.mlp_extractor.policy_net.parameters()) + list(policy.action_net.parameters())
    for p in frozen:
        p.requires_grad_(False)
    try:
        learn(model, venv, timesteps, timesteps, callback, logger, progress)
    finally:
        for p in frozen:
            p.requires_grad_(True)


def clone(model, venv, observations, actions, weights=None, epochs: int = 10, batch: int = 256, lr: float = 1e-3,
          seed: int = 0) -> list[float]:
    """Behaviour cloning of ``actions`` at ``observations`` (e.g. the oracle's decisions at replayed states,
    ``rift_ada.trainers.oracle_labels``) into the PPO policy, each state weighted by ``weights``: a start that
    already refreshes where refreshing pays, which PPO then improves on its own reward. VecNormalize's observation
    statistics start as the demonstrations' (and keep updating during PPO). Returns the loss per epoch."""
    X = np.asarray(observations, dtype=np.float64)
    venv.obs_rms.mean, venv.obs_rms.var, venv.obs_rms.count = X.mean(0), X.var(0), float(len(X))
    obs = torch.as_tensor(venv.normalize_obs(X), dtype=torch.float32)
    act = torch.as_tensor(np.asarray(actions), dtype=torch.long)
    w = torch.ones(len(X)) if weights is None else torch.as_tensor(np.asarray(weights), dtype=torch.float32)
    w = w / w.mean()
    policy = model.policy
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(epochs):
        order, total = torch.randperm(len(X), generator=g), 0.0
        for i in range(0, len(X), batch):
            idx = order[i:i + batch]
            loss = -(w[idx] * policy.get_distribution(obs[idx]).log_prob(act[idx])).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(X))
    return losses


def learn(model, venv, timesteps: int, bar_total: int, callback=None, logger=None, progress: str | None = None,
          reset: bool = True):
    """``model.learn`` with SB3's logger routed (e.g. to W&B) and a progress bar of ``bar_total`` steps titled
    ``progress`` (none if None); ``reset=False`` continues the step count of an earlier call. Returns (model,
    venv)."""
    if logger is not None:
        model.set_logger(logger)
    if progress is not None:
        bar = progress_callback(bar_total, progress)
        callback = bar if callback is None else [callback, bar]
    model.learn(total_timesteps=timesteps, callback=callback, progress_bar=False, reset_num_timesteps=reset)
    return model, venv


def export_mlp(cls: type[MLPController], modules, vec_normalize=None, lam: float | None = None) -> MLPController:
    """``modules`` (SB3's Linear layers with their activations between, ending in the 2-output layer) as a ``cls``
    controller, with VecNormalize's observation statistics baked in (none: an identity normalisation)."""
    net, sizes, act = copy_mlp(modules)
    mean, var, eps, clip = normalisation(vec_normalize, sizes[0])
    return cls(net, sizes, act, mean, var, eps, clip, lam)


def copy_mlp(modules):
    """SB3's Linear layers with their activations between as a torch-only ``build_mlp`` network: (net, sizes,
    activation name)."""
    linears = [m for m in modules if isinstance(m, torch.nn.Linear)]
    acts = {type(m).__name__.lower() for m in modules if not isinstance(m, torch.nn.Linear)}
    if len(acts) > 1 or not acts <= {"tanh", "relu"}:
        raise ValueError(f"cannot export an MLP with activations {sorted(acts)}: tanh or relu only")
    sizes = [linears[0].in_features] + [lin.out_features for lin in linears]
    act = acts.pop() if acts else "tanh"
    net = build_mlp(sizes, act)
    for dst, src in zip([m for m in net if isinstance(m, torch.nn.Linear)], linears):
        dst.load_state_dict(src.state_dict())
    return net.eval(), sizes, act


def normalisation(vec_normalize, n: int):
    """VecNormalize's observation statistics as (mean, var, epsilon, clip); none: an identity normalisation."""
    if vec_normalize is not None and vec_normalize.norm_obs:
        rms = vec_normalize.obs_rms
        return (np.asarray(rms.mean, np.float64), np.asarray(rms.var, np.float64), float(vec_normalize.epsilon),
                float(vec_normalize.clip_obs))
    return np.zeros(n), np.ones(n) - 1e-8, 1e-8, np.inf