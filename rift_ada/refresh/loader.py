"""Loading any saved controller without scikit-learn or stable-baselines3, and the ``--controller`` spelling."""

from __future__ import annotations

import math
from pathlib import Path

from .base import read_json_object
from .logistic import LogisticController
from .mlp import load_mlp_controller
from .rules import EntropyController, NeverController, PeriodicController, ThresholdController

_JSON_KINDS = {"never": NeverController, "periodic": PeriodicController, "threshold": ThresholdController,
               "entropy": EntropyController, "logistic": LogisticController}


def load_controller(path: str | Path):
    """A controller from a ``.json`` (rules, logistic) or ``.pt`` (PPO, DQN) file.

    FileNotFoundError for a missing file; ValueError, in one line naming the file and what is wrong, for a file that
    is not a valid controller (corrupt, truncated, wrong structure, wrong types, unknown kind, other signals).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"controller file {str(path)!r} does not exist")
    if path.suffix == ".pt":
        return load_mlp_controller(path)
    kind = read_json_object(path).get("kind")
    if not isinstance(kind, str) or kind not in _JSON_KINDS:
        what = "no 'kind' field" if kind is None else f"unknown controller kind {kind!r}"
        raise ValueError(f"{path}: {what}; a .json controller is one of "
                         f"{', '.join(_JSON_KINDS)} (PPO and DQN controllers are .pt files)")
    return _JSON_KINDS[kind].load(path)


def parse_controller(spec: str):
    """``never``, ``periodic:N`` (refresh every N generated tokens), ``entropy:X`` (refresh when the last round's
    mean draft entropy / ln vocab exceeds X in [0, 1]) or the path of a saved controller file."""
    name, _, arg = spec.partition(":")
    if name == "never" and not arg:
        return NeverController()
    if name == "periodic":
        try:
            return PeriodicController(int(arg))
        except ValueError:
            raise ValueError(f"--controller {spec!r}: write periodic:N with N >= 1 generated tokens between "
                             "refreshes") from None
    if name == "entropy":
        try:
            return EntropyController(float(arg))
        except ValueError:
            hint = ""
            try:
                if float(arg) > 1:  # nats, probably: say how to convert
                    hint = (f"; X is not in nats: {float(arg):g} nats with a 32K vocabulary is "
                            f"entropy:{float(arg) / math.log(32000):.3f}")
            except ValueError:
                pass
            raise ValueError(f"--controller {spec!r}: write entropy:X with X in [0, 1], the level of the entropy_mean "
                             f"signal (mean draft entropy / ln vocab) above which to refresh{hint}") from None
    if Path(spec).suffix in (".json", ".pt") or Path(spec).exists():
        return load_controller(spec)
    raise ValueError(f"--controller {spec!r}: give never, periodic:N, entropy:X, or a controller file (.json or .pt)")
