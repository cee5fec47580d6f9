"""The exported form of controllers learned as neural networks: a plain torch MLP (the PPO and DQN kinds of
``rift_ada.controllers`` subclass :class:`MLPController`); deciding and loading need only torch.

An exported file holds the MLP (PPO: ``mlp_extractor.policy_net`` + ``action_net``; DQN: ``q_net.q_net`` after the
flattening features extractor), its activation, the VecNormalize observation statistics baked in, the signal order,
the ``kind`` (``ppo`` or ``dqn``) and the refresh-cost weight lambda it was trained with. ``decide`` is the argmax of
the MLP's two outputs (PPO: action logits; DQN: Q-values), which is what ``model.predict(obs, deterministic=True)``
returns for either algorithm.

Loading uses ``torch.load(weights_only=True)`` (tensors and plain values only: a controller file from elsewhere cannot
run code) and checks every field, so a corrupt, truncated or foreign file is refused in one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from .. import signals
from ..files import read_torch
from .base import Controller, Knob, check_observation, check_signal_order, number, numbers, short
from .registry import known, kinds

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def normalize(obs: np.ndarray, mean, var, epsilon: float, clip: float) -> np.ndarray:
    """VecNormalize's observation transform, as an exported controller applies it."""
    return np.clip((obs - mean) / np.sqrt(var + epsilon), -clip, clip)


def build_mlp(sizes: list[int], activation: str) -> nn.Sequential:
    """Linear layers of ``sizes`` (input .. 2 outputs) with ``activation`` between hidden layers."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(_ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


@dataclass
class MLPController(Controller):
    """The exported form shared by the neural kinds (``rift_ada.controllers``: PPO, DQN); subclass it with a ``kind``."""

    kind: ClassVar[str] = ""
    suffix: ClassVar[str] = ".pt"
    # Trained once per refresh-cost weight (``lam``, in the replay environment), only when --learners names the kind.
    knob: ClassVar[Knob] = Knob("lams", float, (8.0,), "refresh-cost weights for the learners (their knob on the "
                                "tradeoff curve)", low=0)
    optional: ClassVar[bool] = True
    net: nn.Sequential
    sizes: list[int]
    activation: str = "tanh"
    obs_mean: np.ndarray = field(default_factory=lambda: np.zeros(len(signals.NAMES)))
    obs_var: np.ndarray = field(default_factory=lambda: np.ones(len(signals.NAMES)))
    epsilon: float = 1e-8
    clip: float = 10.0
    lam: float | None = None  # the refresh-cost weight it was trained with (its knob)

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        return normalize(obs, self.obs_mean, self.obs_var, self.epsilon, self.clip)

    @torch.no_grad()
    def decide_batch(self, observations: np.ndarray) -> np.ndarray:
        x = torch.as_tensor(self.normalize(np.asarray(observations, dtype=np.float64)), dtype=torch.float32)
        return self.net(x).argmax(-1).numpy()

    def decide(self, observation) -> bool:
        return bool(self.decide_batch(check_observation(observation)[None])[0])

    def save(self, path) -> None:
        # Plain Python numbers: numpy scalars are not among the types a weights-only load accepts.
        torch.save({"kind": self.kind, "signals": list(signals.NAMES), "sizes": [int(s) for s in self.sizes],
                    "activation": self.activation, "state_dict": self.net.state_dict(),
                    "obs_mean": np.asarray(self.obs_mean, dtype=np.float64).tolist(),
                    "obs_var": np.asarray(self.obs_var, dtype=np.float64).tolist(), "epsilon": float(self.epsilon),
                    "clip": float(self.clip), "lam": None if self.lam is None else float(self.lam)}, path)

    @classmethod
    def load(cls, path: str | Path) -> "MLPController":
        """A controller of this class's kind saved by :meth:`save`; ValueError (one line naming the file) for anything
        else, a controller of the other kind included."""
        d = read_torch(path, f"a {_kinds()} controller file")
        if not isinstance(d, dict) or d.get("kind") != cls.kind:
            held = f"kind {d.get('kind')!r}" if isinstance(d, dict) else f"a {type(d).__name__}"
            raise ValueError(f"{path}: not a {cls.kind.upper()} controller file (it holds {held}; expected a dict "
                             f"with kind {cls.kind!r})")
        return cls._from_dict(d, path)

    @classmethod
    def _from_dict(cls, d: dict, path) -> "MLPController":
        check_signal_order(d.get("signals"), path)
        n = len(signals.NAMES)
        sizes = d.get("sizes")
        if not (isinstance(sizes, list) and len(sizes) >= 2 and sizes[0] == n and sizes[-1] == 2
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)):
            raise ValueError(f"{path}: 'sizes' must list the MLP's widths from {n} signals to 2 actions, "
                             f"got {short(sizes)}")
        if not isinstance(d.get("activation"), str) or d["activation"] not in _ACTIVATIONS:
            raise ValueError(f"{path}: 'activation' must be one of {', '.join(_ACTIVATIONS)}, "
                             f"got {short(d.get('activation'))}")
        net = build_mlp(sizes, d["activation"])
        load_weights(net, d.get("state_dict"), path)
        return cls(net.eval(), sizes, d["activation"], np.asarray(numbers(d, "obs_mean", path, n)),
                   np.asarray(numbers(d, "obs_var", path, n, minimum=0)),
                   number(d, "epsilon", path, minimum=0), number(d, "clip", path, minimum=0, finite=False),
                   None if d.get("lam") is None else number(d, "lam", path))


def _kinds() -> str:
    """The registered kinds saved as .pt files, for messages ("PPO or DQN")."""
    return " or ".join(k.upper() for k in kinds(".pt"))


def load_mlp_controller(path: str | Path, d=None) -> MLPController:
    """A controller from a ``.pt`` file, of whichever registered kind it holds (``d``: the file's content, read)."""
    d = read_torch(path, f"a {_kinds()} controller file") if d is None else d
    if not isinstance(d, dict) or d.get("kind") not in kinds(".pt"):
        held = f"kind {d.get('kind')!r}" if isinstance(d, dict) else f"a {type(d).__name__}"
        raise ValueError(f"{path}: not a {_kinds()} controller file (it holds {held}; expected a dict with kind "
                         f"{' or '.join(map(repr, kinds('.pt')))})")
    return known()[d["kind"]]._from_dict(d, path)


def load_weights(net: nn.Sequential, state, path) -> None:
    """Copy ``state`` into ``net`` after checking its names, shapes and values (one line for the first mismatch)."""
    expected = net.state_dict()
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: 'state_dict' must map parameter names to tensors, got {short(state)}")
    if set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise ValueError(f"{path}: 'state_dict' does not fit 'sizes' (missing {missing or 'none'}, "
                         f"unexpected {extra or 'none'})")
    for k, v in expected.items():
        if state[k].shape != v.shape:
            raise ValueError(f"{path}: 'state_dict' entry {k!r} has shape {tuple(state[k].shape)}, but 'sizes' "
                             f"needs {tuple(v.shape)}")
        if not state[k].is_floating_point() or not torch.isfinite(state[k]).all():
            raise ValueError(f"{path}: 'state_dict' entry {k!r} holds non-finite or non-float values")
    net.load_state_dict(state)
