"""Prompts: long-context code tasks built from Python files, SPEED-Bench, and a plain JSONL format."""

from .corpus import SourceFile, load_corpus
from .jsonl import load_jsonl, save_jsonl
from .speedbench import load_speedbench
from .tasks import FAMILIES, Task, build_tasks, encode, encode_prompts

__all__ = ["FAMILIES", "SourceFile", "Task", "build_tasks", "encode", "encode_prompts", "load_corpus", "load_jsonl", "load_speedbench",
           "save_jsonl"]
