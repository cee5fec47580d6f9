"""Prompts: long-context code tasks built from Python files, SPEED-Bench, and a plain JSONL format."""

from .corpus import SourceFile, load_corpus
from .jsonl import load_jsonl, save_jsonl
from .speedbench import load_speedbench
from .tasks import TASK_FAMILIES, Task, build_task_mix, build_tasks, encode, encode_prompts, task_mix

__all__ = ["TASK_FAMILIES", "SourceFile", "Task", "build_task_mix", "build_tasks", "encode", "encode_prompts",
           "load_corpus", "load_jsonl", "load_speedbench", "save_jsonl", "task_mix"]
