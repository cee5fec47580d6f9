"""SPEED-Bench (NVIDIA's speculative decoding benchmark) from a local JSONL or parquet file.

Rows have ``question_id, category, sub_category, turns, source, src_id, difficulty, multiturn``. In the throughput
splits ``category`` is ``low_entropy`` / ``mixed`` / ``high_entropy``. The public parquet ships placeholder turns that
NVIDIA's preparation script fills from the source datasets; such rows are refused with the row named.
Only the first user turn is used (one request per row, as in the benchmark's throughput runs).
"""

from __future__ import annotations

import json
from pathlib import Path

from .tasks import Task

REQUIRED = ("question_id", "category", "turns")
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE"
CATEGORY_ALIASES = {"low": "low_entropy", "high": "high_entropy", "mixed": "mixed"}


def _read_rows(path: Path) -> list:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading .parquet needs pyarrow: pip install 'rift-ada[speedbench]'") from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's ArrowInvalid / OSError for a corrupt or truncated file
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{path}: not a readable parquet file ({reason})") from None
    rows = []
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); a SPEED-Bench .jsonl file "
                                         "holds one JSON object per line") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; SPEED-Bench files are .jsonl (text) or .parquet (by suffix)") \
            from None
    return rows


def load_speedbench(
    path: str | Path,
    tokenizer=None,
    category: str | None = None,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
    chat_template: bool = True,
) -> list[Task]:
    """Prompts of a SPEED-Bench file, optionally filtered by category and prompt length (in ``tokenizer`` tokens).

    With ``chat_template`` and a tokenizer that has one, the turn is rendered as a user message with the generation
    prompt appended (what a chat model is served); otherwise the raw turn text is the prompt.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SPEED-Bench file {str(path)!r} does not exist")
    if (min_tokens is not None or max_tokens is not None) and tokenizer is None:
        raise ValueError("length filters need a tokenizer")
    if category is not None:
        category = CATEGORY_ALIASES.get(category, category)
    tasks = []
    for i, row in enumerate(_read_rows(path)):
        where = f"{path.name} row {i} (question_id {row.get('question_id', '?')!r})" if isinstance(row, dict) \
            else f"{path.name} row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object with {', '.join(REQUIRED)}, got a {type(row).__name__}")
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(missing)}; not a SPEED-Bench file?")
        if not isinstance(row["question_id"], (str, int)) or isinstance(row["question_id"], bool):
            raise ValueError(f"{where}: 'question_id' must be a string or an integer")
        if not isinstance(row["category"], str):
            raise ValueError(f"{where}: 'category' must be a string (low_entropy, mixed, high_entropy, ...)")
        turns = row["turns"]
        if not isinstance(turns, (list, tuple)) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        if PLACEHOLDER in turns[0] or not turns[0].strip():
            raise ValueError(f"{where}: the prompt is an unfilled placeholder; run SPEED-Bench's preparation script "
                             "to fetch the source data first")
        if category is not None and row["category"] != category:
            continue
        prompt = turns[0]
        if chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
        if tokenizer is not None and (min_tokens is not None or max_tokens is not None):
            n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if (min_tokens is not None and n < min_tokens) or (max_tokens is not None and n > max_tokens):
                continue
        tasks.append(Task(task_id=str(row["question_id"]), family=str(row["category"]), prompt=prompt,
                          reference="", target_file="", files=()))
    return tasks
