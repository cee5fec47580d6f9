"""Writing the files the project reads back: whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write(path: str | Path, write) -> Path:
    """``write(tmp_path)``, then move the result to ``path`` in one step (a kill leaves the old file or the new one,
    never half of one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")  # same folder (os.replace stays atomic), same suffix
    write(tmp)
    os.replace(tmp, path)
    return path


def write_json(path: str | Path, payload) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=1)))
