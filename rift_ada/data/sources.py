"""Code bases to build prompts from, by name: ``stdlib`` (the standard library's split the testbed trained on, or
its held-out split), an installed package (``numpy``: its folder, found without importing it) or a folder.

A learner that should carry to code it never saw trains on several code bases and is judged on another
(``experiments/train_controller.py``: ``--train-sources`` and ``--source-dir``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .tasks import build_task_mix


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


def build_source_mix(tokenizer, sources: list[str], task: str, per_source: int, input_tokens: int, seed: int,
                     stdlib_split: str = "train") -> list[tuple[str, object]]:
    """``per_source`` prompts from each code base (cycling through ``task``'s families, each code base starting at
    the next family so every family is drawn from several code bases), as (code base, Task) pairs, interleaved by
    code base."""
    from .tasks import task_mix

    families = task_mix(task)
    per = []
    for j, name in enumerate(sources):
        folder = source_folder(name)
        order = ",".join(families[(j + i) % len(families)] for i in range(len(families)))
        tasks = build_task_mix(tokenizer, order, per_source, input_tokens, seed, stdlib_split if folder is None
                               else None, source_dir=folder)
        per.append([(name, t) for t in tasks])
    return [pair for i in range(per_source) for tasks in per for pair in tasks[i:i + 1]]
