"""Loading any saved controller without scikit-learn or stable-baselines3 (the decoding loop's only import)."""

from __future__ import annotations

import json
from pathlib import Path

from .logistic import LogisticController
from .ppo import PPOController
from .rules import NeverController, PeriodicController, ThresholdController

_JSON_KINDS = {"never": NeverController, "periodic": PeriodicController, "threshold": ThresholdController,
               "logistic": LogisticController}


def load_controller(path: str | Path):
    """A controller from a ``.json`` (rules, logistic) or ``.pt`` (PPO) file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"controller file {str(path)!r} does not exist")
    if path.suffix == ".pt":
        return PPOController.load(path)
    try:
        kind = json.loads(path.read_text()).get("kind")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path} is neither a controller JSON file nor a .pt PPO controller") from None
    if kind not in _JSON_KINDS:
        raise ValueError(f"{path}: unknown controller kind {kind!r}")
    return _JSON_KINDS[kind].load(path)
