"""The learned refresh controller kinds, one file each: the exported form that decides, saves and loads with neither
scikit-learn nor stable-baselines3, how it is fitted, and how the main job trains it (``Controller.train``).

A new learned kind is a file here with one ``@register``ed class, and its import below (the registration; the
import order is the order of the sweeps' families). The core finds this package through the
``rift_ada.controllers`` entry point (pyproject.toml), never by importing it.
"""

from . import tree, logistic, ppo, dqn  # noqa: F401  (registers the kinds, in this order)
from .dqn import DQNController, export_dqn
from .logistic import LogisticController, fit_logistic, learning_curve
from .ppo import PPOController, export_ppo
from .tree import TreeController, fit_tree

__all__ = ["DQNController", "LogisticController", "PPOController", "TreeController", "export_dqn", "export_ppo",
           "fit_logistic", "fit_tree", "learning_curve"]
