"""When to refresh: the controller base class and its registry, the rule controllers, the exported form of neural
controllers and the loader of any controller file. Pure numpy / torch: deciding never needs scikit-learn or
stable-baselines3. The learned kinds (tree, logistic, PPO, DQN) live in ``rift_ada.controllers``, one file each.

A controller sees only the signal vector (``rift_ada.signals``), never the models; ``decide`` returns True to
rescore the draft cache before the coming round. ``rift-dyn`` is a RIFT layout plus ``PeriodicController``.
"""

# Imported in this order, the kinds register in it: the order of the sweeps' families.
from .base import Controller, GapRule, Knob, Option, refresh_wanted
from .rules import EntropyController, NeverController, PeriodicController, ThresholdController
from .mlp import MLPController
from .loader import controller_files, load_controller, load_controllers, parse_controller
from .registry import register

__all__ = ["Controller", "EntropyController", "GapRule", "Knob", "MLPController", "NeverController", "Option",
           "PeriodicController", "ThresholdController", "controller_files", "load_controller", "load_controllers",
           "parse_controller", "refresh_wanted", "register"]
