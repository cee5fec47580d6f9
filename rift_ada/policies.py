"""Named cache policies, the ``--policy`` spelling of the command-line tools: a cache layout plus a refresh controller
(a ``CachePolicy``; not the policy network of reinforcement learning, which the trainers call ``model.policy``).

| policy      | layout (``rift_ada.layout``)        | refresh controller (``rift_ada.refresh``)                  |
|-------------|-------------------------------------|------------------------------------------------------------|
| `full`      | full                                | -                                                          |
| `window`    | window (4 sinks + recent tokens)    | -                                                          |
| `snapkv`    | snapkv                              | -                                                          |
| `rift-stat` | rift, no backing store              | - (the selection made at prefill stays)                    |
| `rift-dyn`  | rift                                | ``PeriodicController(period)``                             |
| `rift-ada`  | rift                                | the one given: a file, ``periodic:N`` or ``never``         |

So ``--policy rift-dyn --period 32`` and ``--policy rift-ada --controller periodic:32`` are one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import CacheLayout
from .refresh import Controller, PeriodicController, parse_controller

POLICIES = ("full", "window", "snapkv", "rift-stat", "rift-dyn", "rift-ada")


@dataclass(frozen=True)
class CachePolicy:
    name: str
    layout: CacheLayout
    controller: Controller | None  # None: never refresh


def make_policy(name: str, budget: int | None = None, *, period: int | None = None,
                controller: Controller | str | None = None, window_fraction: float = 0.5, window: int | None = None,
                sinks: int = 4, scorer: str = "snapkv", obs_window: int = 32, lookahead: int = 64,
                scorer_options=(), refresh_grid: int = 1) -> CachePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if period is not None and name != "rift-dyn":
        raise ValueError("--period only applies to --policy rift-dyn (or write --policy rift-ada --controller "
                         "periodic:N)")
    if controller is not None and name != "rift-ada":
        raise ValueError("--controller only applies to --policy rift-ada")
    kind = "rift" if name.startswith("rift") else name
    layout = CacheLayout(kind, budget=None if name == "full" else budget, window_fraction=window_fraction,
                         window=window, sinks=sinks, scorer=scorer, obs_window=obs_window, lookahead=lookahead,
                         scorer_options=tuple(dict(scorer_options).items()), store=name != "rift-stat",
                         refresh_grid=refresh_grid)
    if name == "rift-dyn":
        if period is None:
            raise ValueError("rift-dyn needs --period (generated tokens between refreshes)")
        controller = PeriodicController(period)
    elif name == "rift-ada":
        if controller is None:
            raise ValueError("--policy rift-ada needs --controller: a controller file (runs/controller/controller.json "
                             "or .pt), periodic:N, entropy:X or never")
        if isinstance(controller, str):
            controller = parse_controller(controller)
    return CachePolicy(name, layout, controller)
