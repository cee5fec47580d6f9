"""Loading target and draft models: the built-in testbed, a local folder, or a hub id.

Everything goes through ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``: the testbed is
an ordinary HuggingFace folder, so the code path that loads it is the one that loads ``Qwen/Qwen3-8B`` on a GPU box.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

TESTBED_DIR = Path(__file__).resolve().parent / "testbed" / "assets"
TESTBED_NAMES = {"testbed": "target", "testbed-target": "target", "testbed-draft": "draft"}


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says what to do."""


def resolve(name_or_path: str | os.PathLike) -> str:
    """Map the testbed's short names to their folders; check that a local-looking path exists."""
    name = str(name_or_path)
    if name in TESTBED_NAMES:
        folder = TESTBED_DIR / TESTBED_NAMES[name]
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"the testbed model {name!r} is missing at {folder}; rebuild it with "
                                 "`python experiments/build_testbed.py`")
        return str(folder)
    path = Path(name).expanduser()
    looks_local = name.startswith((".", "/", "~")) or path.exists()
    if looks_local:
        if not path.is_dir():
            raise ModelLoadError(f"model folder {name!r} does not exist (expected a folder with config.json, "
                                 "or a hub id such as 'Qwen/Qwen3-8B')")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name!r} is a folder but holds no config.json: not a HuggingFace model folder")
        return str(path)
    return name  # a hub id


def load_tokenizer(name_or_path: str | os.PathLike):
    from transformers import AutoTokenizer

    where = resolve(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(where)
    except OSError as e:
        raise ModelLoadError(f"could not load a tokenizer from {where!r}: {e}") from e


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype | str | None = None, device: str = "cpu",
               attn_implementation: str | None = "sdpa"):
    """Load a causal LM in eval mode. ``dtype=None`` keeps float32 on CPU and bfloat16 on CUDA."""
    from transformers import AutoModelForCausalLM

    where = resolve(name_or_path)
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as e:
        raise ModelLoadError(f"could not load a model from {where!r}: {e}") from e
    return model.to(device).eval()


@dataclass
class ModelPair:
    """A target, the model that drafts for it (the same object for self-speculation) and their tokenizer."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    self_speculative: bool

    @property
    def max_positions(self) -> int:
        return min(getattr(m.config, "max_position_embeddings", 1 << 30) for m in (self.target, self.draft))


def load_pair(target: str = "testbed", drafter: str = "testbed", device: str = "cpu", dtype=None) -> ModelPair:
    """``drafter``: ``self`` (the target drafts for itself), ``testbed`` (the built-in draft), or a path / hub id."""
    tok = load_tokenizer(target)
    tgt = load_model(target, dtype=dtype, device=device)
    if drafter == "self":
        return ModelPair(tgt, tgt, tok, True)
    drf = load_model("testbed-draft" if drafter == "testbed" else drafter, dtype=dtype, device=device)
    check_vocab(tgt, drf)
    return ModelPair(tgt, drf, tok, False)


def check_vocab(target, draft) -> None:
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(f"the drafter's vocabulary ({vd} tokens) differs from the target's ({vt}): draft and "
                         "target must share a tokenizer")
