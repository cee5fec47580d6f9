"""The controller protocol: a refresh decision from the signal vector alone.

Controllers see only the numpy observation (``rift_ada.signals``), never the models, so they stay tiny, testable and
exportable. ``decide`` returns True to refresh the draft cache before the coming round.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from rift_ada import signals


@runtime_checkable
class Controller(Protocol):
    name: str

    def reset(self) -> None: ...

    def decide(self, observation: np.ndarray) -> bool: ...

    def save(self, path: str | Path) -> None: ...


def check_observation(observation) -> np.ndarray:
    obs = np.asarray(observation, dtype=np.float32).reshape(-1)
    if obs.shape[0] != len(signals.NAMES):
        raise ValueError(f"expected an observation of {len(signals.NAMES)} signals ({', '.join(signals.NAMES)}), "
                         f"got {obs.shape[0]}")
    return obs


def write_json(path: str | Path, payload: dict) -> None:
    payload = {"signals": list(signals.NAMES), **payload}
    Path(path).write_text(json.dumps(payload, indent=1))


def read_json(path: str | Path, kind: str) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("kind") != kind:
        raise ValueError(f"{path} holds a {data.get('kind')!r} controller, not {kind!r}")
    check_signal_order(data.get("signals"), path)
    return data


def check_signal_order(names, path) -> None:
    if list(names or []) != list(signals.NAMES):
        raise ValueError(f"{path} was trained on signals {names}, but this version observes {list(signals.NAMES)}")
