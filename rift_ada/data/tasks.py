"""Long-context code tasks built deterministically from a corpus of Python files.

Every prompt is several source files, each behind a ``# file: NAME`` header, followed by a marker and the opening
lines of the file to write next. The three families differ in how much of the right continuation the prompt holds:

- ``low``   (copy):     the file is in the prompt; ``# copy of: NAME`` asks for it again. The continuation copies the
                        rest of it, so a model must retrieve from wherever that file sits, often far back.
- ``mixed`` (continue): the first part of the file (imports, definitions) is in the prompt; ``# continued: NAME``
                        opens its second part, which reuses those identifiers but is not in the prompt.
- ``high``  (free):     a file the prompt does not hold; ordinary code completion.
- ``sort``  (reorder):  labelled passages (functions and classes cut from files, ``# passage C``), then
                        ``# order: C, A, ...``; the continuation writes every passage again in that order, so
                        retrieval jumps between distant regions as generation proceeds (SPEED-Bench's sorting
                        category of the low-entropy tier).

Prompts are cut at line ends. For tokenizers that keep newlines as their own pre-tokens (the testbed's) this makes
``tokenize(prompt + reference) == tokenize(prompt) + tokenize(reference)``.
"""

from __future__ import annotations

import ast
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .corpus import SourceFile, load_corpus

TASK_FAMILIES = ("low", "mixed", "high", "sort")
FILE_HEADER = "# file: {name}\n"
MARKERS = {"low": "# copy of: {name}\n", "mixed": "# continued: {name}\n", "high": "# file: {name}\n"}
HEAD_LINES = 6  # opening lines shown after the marker
MIN_HEAD_TOKENS = 16
# sort: passages outside this range are skipped; prompts longer than 12 x 600 tokens allow passages of up to
# input_tokens / 12, so that 26 labelled passages can fill them (32K-token prompts: 819-2,730 tokens each).
MIN_PASSAGE_TOKENS, MAX_PASSAGE_TOKENS = 24, 600
MIN_CHUNK_TOKENS = 64  # a distractor smaller than this is not worth a header
PASSAGE_HEADER = "# passage {label}\n"
ORDER_LINE = "# order: {order}\n"
LABELS = string.ascii_uppercase  # at most 26 passages in a prompt (most tokenizers: one token each; the
# testbed's writes J K Q V X Y Z as " " + letter)


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
        self._passages: dict[str, list[tuple[str, int]]] = {}

    def __call__(self, f: SourceFile) -> tuple[list[str], list[int]]:
        if f.name not in self._cache:
            lines = f.text.splitlines(keepends=True)
            ids = self.tokenizer(lines, add_special_tokens=False)["input_ids"] if lines else []
            self._cache[f.name] = (lines, [len(x) for x in ids])
        return self._cache[f.name]

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def passages(self, f: SourceFile, cap: int = MAX_PASSAGE_TOKENS) -> list[tuple[str, int]]:
        """Top-level functions and classes of ``f`` (with decorators) as (text, tokens), at most ``cap`` tokens;
        methods of longer classes."""
        if (f.name, cap) not in self._passages:
            lines, counts = self(f)
            try:
                tree = ast.parse(f.text)
            except (SyntaxError, ValueError):
                tree = None
            out = []
            nodes = list(tree.body) if tree is not None else []
            while nodes:
                node = nodes.pop(0)
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
                end = node.end_lineno or node.lineno
                size = sum(counts[start:end])
                if size > cap and isinstance(node, ast.ClassDef):
                    nodes[:0] = node.body  # a long class: its methods are passages of their own
                elif MIN_PASSAGE_TOKENS <= size <= cap:
                    out.append(("".join(lines[start:end]), size))
            self._passages[f.name, cap] = out
        return self._passages[f.name, cap]


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
    if family not in TASK_FAMILIES:
        raise ValueError(f"unknown task family {family!r}; choose one of {', '.join(TASK_FAMILIES)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if min_reference_tokens > reference_tokens:
        raise ValueError("min_reference_tokens must not exceed reference_tokens")
    if input_tokens < reference_tokens // 2 + 4 * MIN_CHUNK_TOKENS:
        need = reference_tokens // 2 + 4 * MIN_CHUNK_TOKENS
        raise ValueError(f"--input-tokens {input_tokens} is too small: built tasks need at least {need} prompt tokens "
                         f"(room for the copied file and a few others beside a {reference_tokens}-token continuation)")
    if files is None:
        files = load_corpus(source_dir, split or ("eval" if source_dir is None else "all"))
    builder = TaskBuilder(tokenizer, files)
    return [builder.build(family, i, input_tokens, reference_tokens, min_reference_tokens, seed) for i in range(n)]


class TaskBuilder:
    """Builds single tasks from one corpus, caching each file's per-line token counts (the testbed trainer draws
    hundreds of thousands of tasks from one builder)."""

    def __init__(self, tokenizer, files: Sequence[SourceFile]):
        self.files = files
        self.lines = _LineTokens(tokenizer)

    def build(self, family: str, i: int, input_tokens: int, reference_tokens: int = 512,
              min_reference_tokens: int = 256, seed: int = 0) -> Task:
        build = _build_sort if family == "sort" else _build_one
        return build(self.lines, self.files, family, i, input_tokens, reference_tokens, min_reference_tokens, seed)


def _build_sort(lt: _LineTokens, files, family, i, input_tokens, reference_tokens, min_reference, seed) -> Task:
    """Labelled passages filling ``input_tokens``, an order line, and the passages again in that order."""
    rng = random.Random(f"rift-ada/{seed}/{family}/{input_tokens}/{i}")
    # Passages large enough that 26 labels fill the prompt, small enough that several fit.
    cap = max(MAX_PASSAGE_TOKENS, input_tokens // 12)
    lo = max(MIN_PASSAGE_TOKENS, input_tokens // 40)
    hi = max(lo, min(cap, input_tokens // 4))
    budget = input_tokens - lt.count(ORDER_LINE.format(order=", ".join(LABELS)))
    chosen: list[tuple[str, str]] = []  # (file name, passage text)
    seen = set()
    for _ in range(4000):  # bounded: a corpus without functions or classes has nothing to offer
        if len(chosen) == len(LABELS) or budget < lo + 8:
            break
        f = files[rng.randrange(len(files))]
        options = [p for p in lt.passages(f, cap) if lo <= p[1] <= min(hi, budget - 8) and (f.name, p[0]) not in seen]
        if not options:
            continue
        text, size = options[rng.randrange(len(options))]
        seen.add((f.name, text))
        chosen.append((f.name, text))
        budget -= size + lt.count(PASSAGE_HEADER.format(label=LABELS[len(chosen) - 1]))
    if len(chosen) < 2:
        raise ValueError(f"the corpus has too few functions or classes of {lo}-{hi} tokens for 'sort' tasks")
    labels = LABELS[:len(chosen)]
    order = list(range(len(chosen)))
    while order == sorted(order):  # the order must differ from the prompt's
        rng.shuffle(order)
    prompt = "".join(PASSAGE_HEADER.format(label=lb) + text for lb, (_, text) in zip(labels, chosen))
    prompt += ORDER_LINE.format(order=", ".join(labels[k] for k in order))
    reference, used = "", 0
    for k in order:  # whole lines, up to reference_tokens
        for line in (PASSAGE_HEADER.format(label=labels[k]) + chosen[k][1]).splitlines(keepends=True):
            n = lt.count(line)
            if used + n > reference_tokens:
                break
            reference, used = reference + line, used + n
        else:
            continue
        break
    return Task(
        task_id=f"{family}-{input_tokens}-{seed}-{i}",
        family=family,
        prompt=prompt,
        reference=reference,
        target_file=chosen[order[0]][0],
        files=tuple(name for name, _ in chosen),
    )


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


def task_mix(task: str) -> list[str]:
    """The families of a comma-separated ``--task`` (``low,high``), in order, each once."""
    return list(dict.fromkeys(f.strip() for f in task.split(",") if f.strip()))


def build_task_mix(tokenizer, task: str, n: int, input_tokens: int, seed: int, split: str | None, bar=None,
                   source_dir: str | Path | None = None, **lengths) -> list[Task]:
    """``n`` tasks cycling through the comma-separated families (low,high -> low, high, low, ...), from the standard
    library's ``split`` or from ``source_dir`` (as :func:`build_tasks`, which ``lengths`` go to:
    ``reference_tokens``, ``min_reference_tokens``); ``bar`` (tqdm) advances once per family."""
    fams = [f.strip() for f in task.split(",") if f.strip()]
    per = {}
    for f in task_mix(task):
        per[f] = build_tasks(tokenizer, f, n=-(-n // len(fams)), input_tokens=input_tokens, seed=seed, split=split,
                             source_dir=source_dir, **lengths)
        if bar is not None:
            bar.update()
    return [per[fams[i % len(fams)]][i // len(fams)] for i in range(n)]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as built (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompts(tokenizer, tasks: Sequence[Task]) -> list[list[int]]:
    return [encode(tokenizer, t.prompt) for t in tasks]
