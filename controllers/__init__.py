"""Refresh controllers that learn, above the core: fitting code that needs scikit-learn (and, in
``rift_ada.trainers``, stable-baselines3). What they produce are ``rift_ada.refresh`` controllers, which decide,
save and load with neither library.
"""

from .logistic import fit_logistic, learning_curve
from .tree import fit_tree

__all__ = ["fit_logistic", "fit_tree", "learning_curve"]
