"""One controller for the whole round: refresh or not, and how many tokens to draft (0: a plain target step), priced
by a cost model measured on the machine (``costs``); the controllers and their observation (``control``)."""

from .control import (DRAFT_LENGTHS, NAMES, FixedJoint, JointController, JointPolicy, LengthTable, actions, baseline,
                      check_joint, is_joint, observe)
from .costs import RoundCosts, machine, measure_round_costs

__all__ = ["DRAFT_LENGTHS", "NAMES", "FixedJoint", "JointController", "JointPolicy", "LengthTable", "RoundCosts",
           "actions", "baseline", "check_joint", "is_joint", "machine", "measure_round_costs", "observe"]
