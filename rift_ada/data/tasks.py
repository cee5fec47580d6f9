"""Long-context code tasks built deterministically from a corpus of Python files.

Every prompt is several source files, each behind a ``# file: NAME`` header, followed by a marker and the opening
lines of the file to write next. The three families differ in how much of the right continuation the prompt holds:

- ``low``   (copy):     the file is in the prompt; ``# copy of: NAME`` asks for it again. The continuation copies the
                        rest of it, so a model must retrieve from wherever that file sits, often far back.
- ``mixed`` (continue): the first part of the file (imports, definitions) is in the prompt; ``# continued: NAME``
                        opens its second part, which reuses those identifiers but is not in the prompt.
- ``high``  (free):     a file the prompt does not hold; ordinary code completion.

Prompts are cut at line ends. For tokenizers that keep newlines as their own pre-tokens (the testbed's) this makes
``tokenize(prompt + reference) == tokenize(prompt) + tokenize(reference)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .corpus import SourceFile, load_corpus

FAMILIES = ("low", "mixed", "high")
FILE_HEADER = "# file: {name}\n"
MARKERS = {"low": "# copy of: {name}\n", "mixed": "# continued: {name}\n", "high": "# file: {name}\n"}
HEAD_LINES = 6  # opening lines shown after the marker
MIN_HEAD_TOKENS = 16
MIN_CHUNK_TOKENS = 64  # a distractor smaller than this is not worth a header


@dataclass(frozen=True)
class Task:
    task_id: str
    family: str
    prompt: str
    reference: str  # the right continuation (what generation is scored against)
    target_file: str
    files: tuple[str, ...]  # names of the files in the prompt, in order


class _LineTokens:
    """Per-line token counts of files, computed lazily and cached (one tokenizer call per file)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[str, tuple[list[str], list[int]]] = {}

    def __call__(self, f: SourceFile) -> tuple[list[str], list[int]]:
        if f.name not in self._cache:
            lines = f.text.splitlines(keepends=True)
            ids = self.tokenizer(lines, add_special_tokens=False)["input_ids"] if lines else []
            self._cache[f.name] = (lines, [len(x) for x in ids])
        return self._cache[f.name]

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _take(lines: list[str], counts: list[int], start: int, budget: int) -> tuple[str, int, int]:
    """Whole lines from ``start`` while they fit in ``budget`` tokens -> (text, tokens, end line)."""
    used, end = 0, start
    while end < len(lines) and used + counts[end] <= budget:
        used += counts[end]
        end += 1
    return "".join(lines[start:end]), used, end


def build_tasks(
    tokenizer,
    family: str = "low",
    n: int = 12,
    input_tokens: int = 2048,
    reference_tokens: int = 512,
    min_reference_tokens: int = 256,
    seed: int = 0,
    source_dir: str | Path | None = None,
    split: str | None = None,
    files: Sequence[SourceFile] | None = None,
) -> list[Task]:
    """Build ``n`` tasks of about ``input_tokens`` prompt tokens for one family.

    ``split`` defaults to ``eval`` (held-out files) for the standard library and ``all`` for a ``source_dir``.
    Task ``i`` depends only on ``(seed, family, i, input_tokens, corpus)``, not on ``n``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; choose one of {', '.join(FAMILIES)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if min_reference_tokens > reference_tokens:
        raise ValueError("min_reference_tokens must not exceed reference_tokens")
    if input_tokens < reference_tokens // 2 + 4 * MIN_CHUNK_TOKENS:
        raise ValueError(f"input_tokens={input_tokens} is too small for tasks (need >= "
                         f"{reference_tokens // 2 + 4 * MIN_CHUNK_TOKENS} with reference_tokens={reference_tokens})")
    if files is None:
        files = load_corpus(source_dir, split or ("eval" if source_dir is None else "all"))
    lt = _LineTokens(tokenizer)
    return [_build_one(lt, files, family, i, input_tokens, reference_tokens, min_reference_tokens, seed)
            for i in range(n)]


def _build_one(lt: _LineTokens, files, family, i, input_tokens, reference_tokens, min_reference, seed) -> Task:
    rng = random.Random(f"rift-ada/{seed}/{family}/{input_tokens}/{i}")
    for _ in range(500):
        target = files[rng.randrange(len(files))]
        lines, counts = lt(target)
        suffix = [0] * (len(counts) + 1)
        for k in range(len(counts) - 1, -1, -1):
            suffix[k] = suffix[k + 1] + counts[k]
        required = (min_reference + MIN_HEAD_TOKENS) * (2 if family == "mixed" else 1)
        if suffix[0] < required:
            continue
        # Where the presented "file" starts: a window of a long file reads as a file of its own.
        start = rng.randrange(max(k for k in range(len(lines)) if suffix[k] >= required) + 1)
        if family == "mixed":
            # The prompt holds part A (definitions); the task continues with part B, which the prompt lacks.
            part_a, _, start = _take(lines, counts, start, max(required // 2, min(input_tokens // 3, suffix[start] // 2)))
        end, head_tokens = start, 0
        while end < len(lines) and (end - start < HEAD_LINES or head_tokens < MIN_HEAD_TOKENS):
            head_tokens += counts[end]
            end += 1
        if suffix[end] >= min_reference:
            break
    else:
        raise ValueError(f"the corpus has too few files long enough for {family!r} tasks "
                         f"(need {min_reference} reference tokens after the opening lines)")
    head = "".join(lines[start:end])
    reference, _, _ = _take(lines, counts, end, reference_tokens)

    marker = MARKERS[family].format(name=target.name)
    tail = marker + head
    budget = input_tokens - lt.count(tail)
    pieces: list[tuple[str, str]] = []  # (name, chunk) of the files in the prompt
    if family == "low":
        pieces.append((target.name, head + reference))
    elif family == "mixed":
        pieces.append((target.name, part_a))
    budget -= sum(lt.count(FILE_HEADER.format(name=nm)) + lt.count(text) for nm, text in pieces)

    distractors = []
    for _ in range(1000):  # bounded: a corpus of one file has no distractors to offer
        if budget <= MIN_CHUNK_TOKENS + 8:
            break
        f = files[rng.randrange(len(files))]
        if f.name == target.name:
            continue
        d_lines, d_counts = lt(f)
        header = FILE_HEADER.format(name=f.name)
        size = min(budget - lt.count(header), rng.randint(128, 1024))
        d_start = rng.randrange(max(1, len(d_lines) // 2))
        text, used, _ = _take(d_lines, d_counts, d_start, size)
        if used < MIN_CHUNK_TOKENS // 2:
            if size < MIN_CHUNK_TOKENS * 2:
                break  # nothing of this size fits any more
            continue
        distractors.append((f.name, text))
        budget -= lt.count(header) + used
    if pieces:
        distractors.insert(rng.randint(0, len(distractors)), pieces[0])
    prompt = "".join(FILE_HEADER.format(name=nm) + text for nm, text in distractors) + tail
    return Task(
        task_id=f"{family}-{input_tokens}-{seed}-{i}",
        family=family,
        prompt=prompt,
        reference=reference,
        target_file=target.name,
        files=tuple(nm for nm, _ in distractors),
    )


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as built (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompts(tokenizer, tasks: Sequence[Task]) -> list[list[int]]:
    return [encode(tokenizer, t.prompt) for t in tasks]
