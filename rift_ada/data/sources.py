"""Code bases to build prompts from, by name: ``stdlib`` (the standard library's split the testbed trained on, or
its held-out split), an installed package (``numpy``: its folder, found without importing it) or a folder.

A learner that should carry to code it never saw trains on several code bases and is judged on another
(``experiments/train_controller.py``: ``--train-sources`` and ``--source-dir``)."""

from __future__ import annotations

from .corpus import source_folder
from .tasks import build_task_mix, task_mix


def build_source_mix(tokenizer, sources: list[str], task: str, per_source: int, input_tokens: int, seed: int,
                     stdlib_split: str = "train") -> list[tuple[str, object]]:
    """``per_source`` prompts from each code base (cycling through ``task``'s families, each code base starting at
    the next family so every family is drawn from several code bases), as (code base, Task) pairs, interleaved by
    code base."""
    families = task_mix(task)
    per = []
    for j, name in enumerate(sources):
        folder = source_folder(name)
        order = ",".join(families[(j + i) % len(families)] for i in range(len(families)))
        tasks = build_task_mix(tokenizer, order, per_source, input_tokens, seed, stdlib_split if folder is None
                               else None, source_dir=folder)
        per.append([(name, t) for t in tasks])
    return [pair for i in range(per_source) for tasks in per for pair in tasks[i:i + 1]]


def mix_sources(sources: list[str] | str, n: int) -> list[int]:
    """Which code base (its index in ``sources``, a list or a comma-separated string) each of the first ``n`` items
    of :func:`build_source_mix` comes from: it interleaves them by code base, and a job's training tables keep that
    order. The one statement of that rule for code that gets the tables back without their sources."""
    count = len(sources.split(",") if isinstance(sources, str) else sources)
    return [i % count for i in range(n)]


__all__ = ["build_source_mix", "mix_sources", "source_folder"]
