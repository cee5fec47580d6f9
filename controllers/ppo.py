"""The PPO controller family: stable-baselines3 PPO in the replay environment (``rift_ada/Replay-v0``), once per
refresh-cost weight (``--lams``), exported as its policy MLP (``mlp_extractor.policy_net`` + ``action_net``) with
VecNormalize's observation statistics baked in. Deciding is the argmax of the action logits, which is
``model.predict(obs, deterministic=True)``; loading and deciding need only torch.

Training (``rift_ada.trainers.ppo.train_ppo``): the policy first clones the decisions of the oracle whose cost is its
reward (unless --no-clone), then its critic warms up with the policy frozen (--ppo-warmup steps), then PPO improves on
it at --ppo-lr without an entropy bonus (it would pull the clone back towards random).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rift_ada.refresh.base import Option
from rift_ada.refresh.mlp import MLPController
from rift_ada.refresh.registry import register


@register
@dataclass
class PPOController(MLPController):
    """PPO's policy MLP: argmax of the action logits."""

    kind: ClassVar[str] = "ppo"
    options: ClassVar[dict] = {
        "timesteps": Option(int, 100_000, "PPO environment steps (rounds) per lambda, rounded up to whole rollouts "
                                          "(128 x --n-envs)", low=1),
        "warmup": Option(int, 20_000, "after cloning, steps in which only PPO's value function learns (more than "
                                      "--ppo-timesteps)", low=0),
        "lr": Option(float, 1e-4, "PPO's learning rate", low=0, open=True)}

    @classmethod
    def train(cls, job) -> list:
        from rift_ada.trainers.oracle_labels import reward_demonstrations
        from rift_ada.trainers.ppo import train_ppo

        points = []
        for lam in job.values(cls):
            settings = {"learning_rate": job.option(cls, "lr")}
            if job.args.clone:  # no entropy bonus on a clone: it would pull the clone back towards random
                a = job.args
                settings.update(demonstrations=reward_demonstrations(job.tables, job.env(lam), a.behaviour_periods,
                                                                     a.label_episodes, a.seed),
                                value_warmup=job.option(cls, "warmup"), ent_coef=0.0)
            points.append((lam, job.reinforce(cls, lam, train_ppo, export_ppo, job.option(cls, "timesteps"),
                                              **settings)))
        return points


def export_ppo(model, vec_normalize=None, lam: float | None = None) -> PPOController:
    """The policy's deterministic action as a plain MLP, with VecNormalize's observation statistics baked in."""
    from rift_ada.trainers.ppo import export_mlp

    policy = model.policy
    return export_mlp(PPOController, list(policy.mlp_extractor.policy_net) + [policy.action_net], vec_normalize, lam)
