"""The testbed's model names, registered with rift-ada's model loading through the ``rift_ada.models`` entry points
(pyproject.toml), so the core finds them without importing the testbed.

``testbed`` / ``testbed-target`` and ``testbed-draft`` give the composed pair (composed.py); ``testbed-lm`` /
``testbed-lm-target`` and ``testbed-lm-draft`` the trained pair alone, so a reader can see which results depend on
the hand-set copier.
"""

from __future__ import annotations

from pathlib import Path

COMPOSED = {"testbed": "target", "testbed-target": "target", "testbed-draft": "draft"}
TRAINED = {"testbed-lm": "target", "testbed-lm-target": "target", "testbed-lm-draft": "draft"}


def folder(name: str) -> Path:
    """The HuggingFace folder of a testbed model (the composed pair is composed into the cache on first use)."""
    from .composed import composed_folder, trained_folder

    if name in TRAINED:
        return trained_folder(TRAINED[name])
    if name in COMPOSED:
        return composed_folder(COMPOSED[name])
    raise ValueError(f"{name!r} is not a testbed model; use one of {', '.join([*COMPOSED, *TRAINED])}")


__all__ = ["COMPOSED", "TRAINED", "folder"]
