"""When to refresh: the controller protocol, the rule controllers, the exported forms of learned controllers and
their loader. Pure numpy / torch: deciding never needs scikit-learn or stable-baselines3.

A controller sees only the signal vector (``rift_ada.signals``), never the models; ``decide`` returns True to
rescore the draft cache before the coming round. ``rift-dyn`` is a RIFT layout plus ``PeriodicController``.
"""

from .base import Controller
from .loader import load_controller, parse_controller
from .logistic import LogisticController
from .mlp import DQNController, PPOController
from .rules import EntropyController, NeverController, PeriodicController, ThresholdController

__all__ = ["Controller", "DQNController", "EntropyController", "LogisticController", "NeverController",
           "PPOController", "PeriodicController", "ThresholdController", "load_controller", "parse_controller"]
