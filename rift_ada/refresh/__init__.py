"""When to refresh: the controller base class and its registry, the rule controllers, the exported forms of learned
controllers and their loader. Pure numpy / torch: deciding never needs scikit-learn or stable-baselines3.

A controller sees only the signal vector (``rift_ada.signals``), never the models; ``decide`` returns True to
rescore the draft cache before the coming round. ``rift-dyn`` is a RIFT layout plus ``PeriodicController``.
"""

# Imported in this order, the kinds register in it: the order of the sweeps' families.
from .base import Controller, GapRule, Knob, refresh_wanted
from .rules import EntropyController, NeverController, PeriodicController, ThresholdController
from .logistic import LogisticController
from .tree import TreeController
from .mlp import DQNController, PPOController
from .loader import load_controller, parse_controller
from .registry import register

__all__ = ["Controller", "DQNController", "EntropyController", "GapRule", "Knob", "LogisticController",
           "NeverController", "PPOController", "PeriodicController", "ThresholdController", "TreeController", "load_controller",
           "parse_controller", "refresh_wanted", "register"]
