"""Refresh controllers: decide from the signal vector when a RIFT cache rescores its history.

Never / periodic / threshold rules, a logistic model and a PPO policy share one protocol (``base.Controller``);
``load_controller`` reads any saved one without scikit-learn or stable-baselines3.
"""

from .base import Controller
from .export import load_controller
from .logistic import LogisticController
from .ppo import PPOController
from .rules import NeverController, PeriodicController, ThresholdController

__all__ = ["Controller", "LogisticController", "NeverController", "PPOController", "PeriodicController",
           "ThresholdController", "load_controller"]
