"""Python source files as a corpus: the running interpreter's standard library, or any folder a user names.

Files are split into train / eval by a hash of their relative path, so the split is the same on every machine and
does not depend on which other files exist.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EVAL_PERCENT = 10  # share of files held out for evaluation
MAX_FILE_BYTES = 300_000  # generated tables and test data beyond this are not code anyone copies
SPLITS = ("train", "eval", "all")


@dataclass(frozen=True)
class SourceFile:
    name: str  # path relative to the corpus root, with "/" separators
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(name: str) -> str:
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100
    return "eval" if bucket < EVAL_PERCENT else "train"


def source_folder(name: str) -> Path | None:
    """The folder of code base ``name`` (None for ``stdlib``); ValueError (one line) for a name that is neither an
    installed package nor a folder."""
    if name == "stdlib":
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(f"code base {name!r} is neither 'stdlib', an installed package nor a folder")
    return Path(locations[0])


def load_corpus(source_dir: str | Path | None = None, split: str = "all", min_lines: int = 1) -> list[SourceFile]:
    """Read every ``*.py`` file under ``source_dir`` (default: the standard library), sorted by name.

    ``split`` keeps the train or eval share of files (``all`` keeps everything: use it for a user's own code base,
    which no testbed model was trained on).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(source_dir) if source_dir is not None else stdlib_dir()
    if not root.is_dir() and isinstance(source_dir, str) and source_dir.isidentifier():
        try:  # an installed package by name (``pip``), as every --source-dir takes
            root = source_folder(source_dir) or stdlib_dir()
        except ValueError:
            pass
    if not root.is_dir():
        raise FileNotFoundError(f"source directory {str(root)!r} does not exist or is not a folder")
    files = []
    for path in sorted(root.rglob("*.py")):
        rel_path = path.relative_to(root)
        rel = rel_path.as_posix()
        # Only below the root: a code base the user names may itself live in site-packages.
        if "site-packages" in rel_path.parts or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        if split != "all" and split_of(rel) != split:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\r\n", "\n").replace("\t", "    ")
        if text.count("\n") >= min_lines:
            files.append(SourceFile(rel, text))
    if not files:
        raise ValueError(f"no readable Python files (split {split!r}) under {str(root)!r}")
    return files
