"""Loading any saved controller without scikit-learn or stable-baselines3, and the ``--controller`` spelling; both
know the kinds ``rift_ada.refresh.registry`` holds."""

from __future__ import annotations

from pathlib import Path

from .base import read_json_object
from .mlp import load_mlp_controller
from .registry import known, kinds


def load_controller(path: str | Path):
    """A controller from a ``.json`` (rules, tree, logistic) or ``.pt`` (PPO, DQN: any registered kind; a joint
    controller, ``rift_ada.joint``) file.

    FileNotFoundError for a missing file; ValueError, in one line naming the file and what is wrong, for a file that
    is not a valid controller (corrupt, truncated, wrong structure, wrong types, unknown kind, other signals).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"controller file {str(path)!r} does not exist")
    if path.suffix == ".pt":
        from ..files import read_torch
        from ..joint.control import KIND, JointPolicy

        d = read_torch(path, f"a controller file ({' or '.join(k.upper() for k in kinds('.pt'))} or joint)")
        if isinstance(d, dict) and d.get("kind") == KIND:
            return JointPolicy.from_dict(d, path)
        return load_mlp_controller(path, d)
    kind = read_json_object(path).get("kind")
    if not isinstance(kind, str) or kind not in kinds(".json"):
        what = "no 'kind' field" if kind is None else f"unknown controller kind {kind!r}"
        raise ValueError(f"{path}: {what}; a .json controller is one of {', '.join(kinds('.json'))} "
                         f"({' and '.join(k.upper() for k in kinds('.pt'))} controllers are .pt files)")
    return known()[kind].load(path)


def controller_files(spec: str | Path) -> list[Path]:
    """The exported controllers ``spec`` names: one file, or a folder's ``controller-*.json`` / ``.pt`` (as the main
    job writes them; a missing folder names none)."""
    path = Path(spec)
    if path.is_file():
        return [path]
    return sorted(x for x in path.glob("controller-*") if x.suffix in (".json", ".pt"))


def load_controllers(specs) -> dict:
    """Every controller the folders or files in ``specs`` name (:func:`controller_files`), by family: its kind
    (``controller-ppo.pt``: ``ppo``), with ``@<folder>`` after it when more than one spec names any
    (``ppo@controller-8k``)."""
    found = [(Path(spec), controller_files(spec)) for spec in specs]
    several = sum(bool(files) for _, files in found) > 1
    out = {}
    for spec, files in found:
        for f in files:
            name = f.stem.removeprefix("controller-")
            out[f"{name}@{(spec if spec.is_dir() else f.parent).name}" if several else name] = load_controller(f)
    return out


def parse_controller(spec: str):
    """A registered kind's spelling (``never``, ``periodic:N``: refresh every N generated tokens, ``entropy:X``:
    refresh when the last round's mean draft entropy / ln vocab exceeds X in [0, 1], ...) or the path of a saved
    controller file."""
    name, colon, arg = spec.partition(":")
    cls = known().get(name)
    if cls is not None and cls.spelling is not None and (":" in cls.spelling or not colon):
        return cls.from_spec(arg, spec)
    if Path(spec).suffix in (".json", ".pt") or Path(spec).exists():
        return load_controller(spec)
    spellings = [c.spelling for c in known().values() if c.spelling is not None]
    raise ValueError(f"--controller {spec!r}: give {', '.join(spellings)}, or a controller file (.json or .pt)")
