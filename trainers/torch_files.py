"""Reading back the torch files the trainers write (checkpoints, target outputs): ``torch.load(weights_only=True)``
only, which builds tensors and plain values (numbers, strings, lists, tuples, dicts) and refuses any other pickled
object before it is built, so a file planted in an output folder cannot run code when a run resumes from it."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import torch


def read_torch(path: str | Path, what: str) -> object:
    """The tensors and plain values in ``path`` (on the CPU). ValueError in one line naming ``path`` and ``what`` it
    should hold, for a file holding other objects or a damaged one (torch's own messages run to many lines and advise
    ``weights_only=False``, which would run the file's code: never done here)."""
    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. torch's note on a pickle protocol it did not write
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001  (torch's reader raises RuntimeError, KeyError, EOFError, ... on damage)
        text = " ".join(str(e).split())
        if isinstance(e, pickle.UnpicklingError):
            called = re.search(r"GLOBAL (\S+)", text)
            held = f"it would call {called.group(1)}" if called else "it holds pickled objects"
            raise ValueError(f"{path}: refused: {held}, and {what} holds only tensors and plain values") from None
        raise ValueError(f"{path}: unreadable as {what} ({type(e).__name__}: {text[:120] or 'no message'}): truncated "
                         "or corrupt") from None
