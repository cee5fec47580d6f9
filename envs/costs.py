"""The cost models an env prices rounds with, as objects, dicts or JSON files (a file that holds one under "costs",
such as a joint job's ``joint.json``, works too), so a config file can name one. The joint env's default is the
testbed pair's measured round costs (``testbed_round_costs.json``, its provenance inside)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rift_ada.costs import CostModel
from rift_ada.joint.costs import RoundCosts

TESTBED_ROUND_COSTS = Path(__file__).resolve().with_name("testbed_round_costs.json")


def round_costs(owner: str, costs) -> RoundCosts:
    """A :class:`RoundCosts` from ``costs`` (None: the testbed pair's)."""
    if costs is None:
        costs = TESTBED_ROUND_COSTS
    if isinstance(costs, RoundCosts):
        return costs
    d, where = _read(owner, costs, "RoundCosts")
    try:
        return RoundCosts.from_dict(d, where)
    except ValueError as e:
        raise ValueError(f"{owner}: costs: {e}") from None


def cost_model(owner: str, costs) -> CostModel | None:
    """A :class:`CostModel` from ``costs`` (None stays None: the tokens reward needs none)."""
    if costs is None or isinstance(costs, CostModel):
        return costs
    d, where = _read(owner, costs, "CostModel")
    try:
        return CostModel.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{owner}: costs: {where} is not a CostModel (draft_step_s, verify_s, refresh_s in seconds): "
                         f"{type(e).__name__}: {e}") from None


def _read(owner: str, costs, kind: str) -> tuple[dict, str]:
    if isinstance(costs, dict):
        d, where = costs, "the dict given"
    elif isinstance(costs, (str, os.PathLike)):
        path = Path(costs).expanduser()
        if not path.is_file():
            raise ValueError(f"{owner}: costs: no such file {str(path)!r} (a JSON file of a {kind})")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{owner}: costs: {path} is not JSON ({e})") from None
        where = str(path)
    else:
        raise TypeError(f"{owner}: costs must be a {kind}, a dict of one or a JSON file of one, got "
                        f"{type(costs).__name__}")
    if isinstance(d, dict) and isinstance(d.get("costs"), dict):
        d = d["costs"]
    if not isinstance(d, dict):
        raise ValueError(f"{owner}: costs: {where} holds no {kind} (a JSON object)")
    return d, where
