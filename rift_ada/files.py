"""Writing the files the project reads back (whole or not at all), reading its torch files back safely, and the
cache folder where what is built on first use is kept (under a lock: several processes may ask for it at once)."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path

import torch


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


def cache_root() -> Path:
    """Where what is built on first use is kept (the composed testbed pair, the envs' default replay tables):
    ``$RIFT_ADA_CACHE``, else ``$XDG_CACHE_HOME/rift_ada`` (``~/.cache``)."""
    if os.environ.get("RIFT_ADA_CACHE"):
        return Path(os.environ["RIFT_ADA_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "rift_ada"


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on ``path`` (test workers and torchrun ranks may all ask for the same build at once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_torch(path: str | Path, what: str) -> object:
    """The tensors and plain values in the torch file ``path`` (on the CPU), for ``what`` it should hold ("a testbed
    checkpoint"). Only ``torch.load(weights_only=True)``: it builds tensors and plain values and refuses any other
    pickled object before building it, so a file planted in an output folder cannot run code when it is read.
    ValueError in one line naming ``path`` for a refused, empty or damaged file: torch's own messages run to many
    lines and advise ``weights_only=False``, which would run the file's code (never done here)."""
    path = Path(path)
    if path.stat().st_size == 0:  # FileNotFoundError passes through: callers say which file was expected
        raise ValueError(f"{path}: the file is empty, not {what}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. torch's note on a pickle protocol it did not write
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (torch's reader raises RuntimeError, KeyError, EOFError, ... on damage)
        text = " ".join(str(e).split())
        called = re.search(r"GLOBAL (\S+)", text)
        with open(path, "rb") as f:
            head = f.read(2)
        pickled = len(head) == 2 and head[0] == pickle.PROTO[0] and 2 <= head[1] <= pickle.HIGHEST_PROTOCOL
        if isinstance(e, pickle.UnpicklingError) and (called or pickled):
            held = f"it would call {called.group(1)}" if called else "it holds pickled objects"
            raise ValueError(f"{path}: refused: {held}, and {what} holds only tensors and plain values") from None
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a truncated one has lost its directory
            raise ValueError(f"{path}: not a torch zip archive: truncated, corrupt, or not {what}") from None
        raise ValueError(f"{path}: unreadable as {what} ({type(e).__name__}: {text[:120] or 'no message'}): "
                         "truncated or corrupt") from None
