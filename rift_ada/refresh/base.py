"""The controller base class: a refresh decision from the signal vector alone.

Controllers see only the numpy observation (``rift_ada.signals``), never the models, so they stay tiny, testable and
exportable. ``decide`` returns True to refresh the draft cache before the coming round. A new kind of controller is a
subclass of :class:`Controller` (its ``kind``, ``decide``, ``save`` and ``load``; a ``spelling`` to be given as
``--controller``, a :class:`Knob` to be swept; a learned kind: ``train``) registered with
``rift_ada.refresh.registry.register``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from .. import signals


@dataclass(frozen=True)
class Knob:
    """What the tradeoff sweeps (``rift_ada.sweep``) vary for a controller kind: the ``name`` of its list of values
    (the command line spells it ``--name-with-dashes``: ``rift_ada.cli.add_knob_options``) and the range those values
    must lie in. No name: one point. A learned kind's knob is the ``field`` its fitted controller is swept over (its
    decision level), or none: it is trained once per value (the refresh-cost weight of PPO and DQN)."""

    name: str | None = None  # e.g. "periods"
    type: type = float
    default: tuple = ()
    help: str = ""
    low: float | None = None
    high: float | None = None
    open: bool = False  # the bounds themselves are excluded
    quantiles_of: str | None = None  # the values are quantiles of this signal in observed states; the knob is its level
    field: str | None = None  # a learned kind's field set to each value (None: the values are given to its training)

    def problem(self, values) -> str | None:
        """What is wrong with ``values`` ("must ...", one line), or None."""
        lo = -math.inf if self.low is None else self.low
        hi = math.inf if self.high is None else self.high
        if all((lo < v < hi) if self.open else (lo <= v <= hi) for v in values):
            return None
        if self.open:
            return f"must lie in ({lo:g}, {hi:g})"
        return f"must be >= {lo:g}" if self.high is None else f"must lie in [{lo:g}, {hi:g}]"


@dataclass(frozen=True)
class Option:
    """A training setting of a learned kind (``Controller.options``), given as ``--KIND-NAME`` on the main job's
    command line (``rift_ada.cli.add_learned_options``)."""

    type: type
    default: object
    help: str
    low: float | None = None  # the lowest value allowed
    open: bool = False  # ``low`` itself excluded


class Controller:
    """Base of the refresh controllers (a small base class, as stable-baselines3's): subclasses set ``kind`` and
    implement :meth:`decide`, :meth:`save` and :meth:`load`. A learned kind also implements :meth:`train` (the main
    job calls it with its training data: ``rift_ada.trainers.controller_job``) and may declare ``options``."""

    kind: ClassVar[str] = ""  # its name: in its files, the sweeps' family column and --controller
    suffix: ClassVar[str] = ".json"  # its files: .json (read without torch) or .pt
    spelling: ClassVar[str | None] = None  # how --controller names it (e.g. "periodic:N"); None: by its file only
    knob: ClassVar[Knob | None] = None  # what the tradeoff sweeps vary
    options: ClassVar[dict[str, Option]] = {}  # a learned kind's training settings, by name
    optional: ClassVar[bool] = False  # a learned kind the main job trains only when --learners names it

    @classmethod
    def learned(cls) -> bool:
        return cls.train.__func__ is not Controller.train.__func__

    @classmethod
    def train(cls, job) -> list[tuple[object, "Controller"]]:
        """A learned kind: ``(knob value, controller)`` for each point the sweeps take, trained on ``job``
        (``rift_ada.trainers.controller_job.Job``: the training tables, the costs, the settings, resumable units)."""
        raise NotImplementedError

    def decide(self, observation: np.ndarray) -> bool:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        raise NotImplementedError

    @classmethod
    def load(cls, path: str | Path) -> "Controller":
        raise NotImplementedError

    @classmethod
    def from_spec(cls, arg: str, spec: str) -> "Controller":
        """The controller ``--controller KIND:ARG`` names (``spec`` is the whole option, for the error message): by
        default the one at ARG of its knob."""
        try:
            return cls.at(cls.knob.type(arg) if cls.knob is not None and cls.knob.name is not None else arg)
        except ValueError:
            raise ValueError(f"--controller {spec!r}: write {cls.spelling}") from None

    @classmethod
    def at(cls, value) -> "Controller":
        """The controller at ``value`` of its knob (a sweep point)."""
        return cls(value)


class GapRule(Controller):
    """A controller that stays quiet within ``min_gap`` generated tokens of the last scoring (low acceptance right
    after a refresh is not staleness) and otherwise refreshes when :meth:`fires`."""

    min_gap: int = 0  # each subclass declares its own dataclass field and default

    def decide(self, observation) -> bool:
        obs = check_observation(observation)
        return since_refresh(obs) >= self.min_gap and self.fires(obs)

    def fires(self, obs: np.ndarray) -> bool:
        raise NotImplementedError


def since_refresh(obs: np.ndarray) -> int:
    """Generated tokens since the last scoring (``rift_ada.signals.tokens_since_refresh``)."""
    return signals.tokens_since_refresh(obs)


def refresh_wanted(controller: Controller | None, state: signals.DecoderState) -> bool:
    """``controller``'s decision before the coming round, from the decoder's published ``state`` (None: never)."""
    return controller is not None and bool(controller.decide(signals.observe(state)))


def check_observation(observation) -> np.ndarray:
    obs = np.asarray(observation, dtype=np.float32).reshape(-1)
    if obs.shape[0] != len(signals.NAMES):
        raise ValueError(f"expected an observation of {len(signals.NAMES)} signals ({', '.join(signals.NAMES)}), "
                         f"got {obs.shape[0]}")
    return obs


def write_controller_file(path: str | Path, payload: dict) -> None:
    """A JSON controller file: ``payload`` (with its ``kind``) and the signal order it decides on."""
    payload = {"signals": list(signals.NAMES), **payload}
    Path(path).write_text(json.dumps(payload, indent=1))


def read_json_object(path: str | Path) -> dict:
    """The JSON object in ``path``; ValueError (one line naming the file) for anything else."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a controller file (not UTF-8 text; neural controllers, such as PPO's, are .pt "
                         "files)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg}); a controller is a .json file (rules, "
                         "trees, linear models) or a .pt file (neural networks)") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not a controller object with a 'kind'")
    return data


def read_json(path: str | Path, kind: str) -> dict:
    data = read_json_object(path)
    if data.get("kind") != kind:
        raise ValueError(f"{path} holds a {data.get('kind')!r} controller, not {kind!r}")
    check_signal_order(data.get("signals"), path)
    return data


def check_signal_order(names, path) -> None:
    if names is None:
        raise ValueError(f"{path}: missing field 'signals' (the signal order the controller was trained on)")
    if not isinstance(names, (list, tuple)) or list(names) != list(signals.NAMES):
        raise ValueError(f"{path} was trained on signals {names}, but this version observes {list(signals.NAMES)}")


# Field checks for loaded files: a wrong field is named in one line, instead of failing later inside decide().
_REQUIRED = object()


def is_number(v, finite: bool = True) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (math.isfinite(v) or not finite)


def number(data: dict, key: str, path, integer: bool = False, minimum: float | None = None,
           maximum: float | None = None, finite: bool = True, default=_REQUIRED):
    """``data[key]`` checked to be a number (an int with ``integer``) within [minimum, maximum]."""
    if key not in data:
        if default is _REQUIRED:
            raise ValueError(f"{path}: missing field {key!r}")
        return default
    v = data[key]
    what = "an integer" if integer else "a finite number" if finite else "a number"
    if not is_number(v, finite) or (integer and not isinstance(v, int)):
        raise ValueError(f"{path}: {key!r} must be {what}, got {short(v)}")
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{path}: {key!r} must be {bounds}, got {v}")
    return v


def numbers(data: dict, key: str, path, length: int, minimum: float | None = None) -> list:
    """``data[key]`` checked to be a list of ``length`` finite numbers (one per signal), each >= ``minimum``."""
    if key not in data:
        raise ValueError(f"{path}: missing field {key!r}")
    v = data[key]
    if (not isinstance(v, list) or len(v) != length or not all(is_number(x) for x in v)
            or (minimum is not None and min(v) < minimum)):
        low = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{path}: {key!r} must be a list of {length} finite numbers{low} (one per signal), "
                         f"got {short(v)}")
    return v


def short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
