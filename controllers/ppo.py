"""A PPO refresh controller as a plain torch MLP: stable-baselines3 trains it (trainers/ppo.py); deciding and
loading need only torch.

The exported file holds the policy MLP (``mlp_extractor.policy_net`` + ``action_net``), its activation, the
VecNormalize observation statistics baked in, and the signal order. ``decide`` is the argmax action, which is what
``PPO.predict(obs, deterministic=True)`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from rift_ada import signals

from .base import check_observation, check_signal_order

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def build_mlp(sizes: list[int], activation: str) -> nn.Sequential:
    """Linear layers of ``sizes`` (input .. 2 logits) with ``activation`` between hidden layers."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(_ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


@dataclass
class PPOController:
    net: nn.Sequential
    sizes: list[int]
    activation: str = "tanh"
    obs_mean: np.ndarray = field(default_factory=lambda: np.zeros(len(signals.NAMES)))
    obs_var: np.ndarray = field(default_factory=lambda: np.ones(len(signals.NAMES)))
    epsilon: float = 1e-8
    clip: float = 10.0
    lam: float | None = None  # the refresh-cost weight it was trained with (its knob)
    name: str = "ppo"

    def reset(self) -> None:
        pass

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        return np.clip((obs - self.obs_mean) / np.sqrt(self.obs_var + self.epsilon), -self.clip, self.clip)

    @torch.no_grad()
    def decide_batch(self, observations: np.ndarray) -> np.ndarray:
        x = torch.as_tensor(self.normalize(np.asarray(observations, dtype=np.float64)), dtype=torch.float32)
        return self.net(x).argmax(-1).numpy()

    def decide(self, observation) -> bool:
        return bool(self.decide_batch(check_observation(observation)[None])[0])

    def save(self, path) -> None:
        torch.save({"kind": "ppo", "signals": list(signals.NAMES), "sizes": self.sizes, "activation": self.activation,
                    "state_dict": self.net.state_dict(), "obs_mean": self.obs_mean.tolist(),
                    "obs_var": self.obs_var.tolist(), "epsilon": self.epsilon, "clip": self.clip, "lam": self.lam},
                   path)

    @classmethod
    def load(cls, path: str | Path) -> "PPOController":
        d = torch.load(path, map_location="cpu", weights_only=True)
        if d.get("kind") != "ppo":
            raise ValueError(f"{path} is not a PPO controller file")
        check_signal_order(d["signals"], path)
        net = build_mlp(d["sizes"], d["activation"])
        net.load_state_dict(d["state_dict"])
        return cls(net.eval(), d["sizes"], d["activation"], np.asarray(d["obs_mean"]), np.asarray(d["obs_var"]),
                   d["epsilon"], d["clip"], d.get("lam"))
