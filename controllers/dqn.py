"""The DQN controller family: stable-baselines3 DQN in the replay environment, once per refresh-cost weight
(``--lams``), the second learner beside PPO, exported as its Q-network (``q_net.q_net`` after the flattening features
extractor) with the observation statistics baked in. Deciding is the argmax of the two Q-values (the greedy action,
no exploration), which is ``DQN.predict(obs, deterministic=True)``; loading and deciding need only torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rift_ada.refresh.base import Option
from rift_ada.refresh.mlp import MLPController
from rift_ada.refresh.registry import register


@register
@dataclass
class DQNController(MLPController):
    """DQN's Q-network: argmax of the two Q-values."""

    kind: ClassVar[str] = "dqn"
    options: ClassVar[dict] = {"timesteps": Option(int, 100_000, "DQN environment steps (rounds) per lambda", low=1)}

    @classmethod
    def train(cls, job) -> list:
        from rift_ada.trainers.dqn import train_dqn

        return [(lam, job.reinforce(cls, lam, train_dqn, export_dqn, job.option(cls, "timesteps")))
                for lam in job.values(cls)]


def export_dqn(model, vec_normalize=None, lam: float | None = None) -> DQNController:
    """The greedy action of the Q-network as a plain MLP, with VecNormalize's observation statistics baked in."""
    from stable_baselines3.common.torch_layers import FlattenExtractor

    from rift_ada.trainers.ppo import export_mlp

    q = model.q_net
    if not isinstance(q.features_extractor, FlattenExtractor):
        raise ValueError(f"cannot export a DQN with a {type(q.features_extractor).__name__}: the flattening features "
                         "extractor of MlpPolicy only")
    return export_mlp(DQNController, list(q.q_net), vec_normalize, lam)
