"""The plain prompt format: one JSON object per line with ``prompt`` (text) and an optional ``reference``."""

from __future__ import annotations

import json
from pathlib import Path

from .tasks import Task


def load_jsonl(path: str | Path, require_reference: bool = False) -> list[Task]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    try:
        return _read_tasks(path, require_reference)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; expected one JSON object per line") from None


def _read_tasks(path: Path, require_reference: bool) -> list[Task]:
    tasks = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise ValueError(f"{path}:{lineno}: each line must be an object with a non-empty string 'prompt'")
            ref = row.get("reference")
            if ref is not None and not isinstance(ref, str):
                raise ValueError(f"{path}:{lineno}: 'reference' must be a string")
            if require_reference and not ref:
                raise ValueError(f"{path}:{lineno}: this command needs a 'reference' (the right continuation)")
            tasks.append(Task(task_id=str(row.get("id", f"{path.stem}-{lineno}")), family="user", prompt=row["prompt"],
                              reference=ref or "", target_file="", files=()))
    if not tasks:
        raise ValueError(f"prompt file {str(path)!r} holds no prompts")
    return tasks


def save_jsonl(tasks, path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as fh:
        for t in tasks:
            fh.write(json.dumps({"id": t.task_id, "prompt": t.prompt, "reference": t.reference}) + "\n")
