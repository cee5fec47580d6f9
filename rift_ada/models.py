"""Loading target and draft models: a registered name (the built-in testbed's), a local folder, or a hub id.

Everything goes through ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``: the testbed is
an ordinary HuggingFace folder, so the code path that loads it is the one that loads ``Qwen/Qwen3-8B`` on a GPU box.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

import torch

# Model names -> a function from the name to a HuggingFace folder. Filled at first use from the "rift_ada.models"
# entry points of the installed distributions (the testbed's: pyproject.toml), so the core imports no provider.
MODEL_GROUP = "rift_ada.models"
MODEL_SOURCES: dict[str, Callable[[str], str | os.PathLike]] = {}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says what to do."""


def model_sources() -> dict[str, Callable[[str], str | os.PathLike]]:
    """:data:`MODEL_SOURCES`, with the registered entry points added the first time it is asked for."""
    _read_entry_points()
    return MODEL_SOURCES


@functools.cache
def _read_entry_points() -> None:
    for ep in entry_points(group=MODEL_GROUP):
        MODEL_SOURCES.setdefault(ep.name, functools.partial(_load_entry_point, ep))


def _load_entry_point(ep, name: str):
    """Import the provider only when one of its names is asked for."""
    try:
        resolver = ep.load()
    except (ImportError, AttributeError) as e:
        raise ModelLoadError(f"model name {name!r} is registered as {ep.value!r}, which does not import "
                             f"({first_line(e)}): reinstall rift-ada (`pip install -e .`)") from None
    return resolver(name)


def resolve(name_or_path: str | os.PathLike) -> str:
    """Map a registered name (:func:`model_sources`) to its folder; check that a local-looking path exists; refuse a
    short name that is neither registered nor a folder."""
    name = str(name_or_path)
    sources = model_sources()
    if name in sources:
        try:
            return str(sources[name](name))
        except (OSError, ValueError) as e:
            raise ModelLoadError(first_line(e)) from None
    path = Path(name).expanduser()
    looks_local = name.startswith((".", "/", "~")) or path.exists()
    if looks_local:
        if not path.is_dir():
            raise ModelLoadError(f"model folder {name!r} does not exist (expected a folder with config.json, "
                                 "or a hub id such as 'Qwen/Qwen3-8B')")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name!r} is a folder but holds no config.json: not a HuggingFace model folder")
        return str(path)
    if "/" not in name:
        known = ", ".join(sorted(sources)) or "none (install rift-ada with `pip install -e .`)"
        raise ModelLoadError(f"unknown model name {name!r} (registered names: {known}); or give a local folder, or "
                             "a hub id such as 'Qwen/Qwen3-8B'")
    return name  # a hub id


def dtype_name(name: str) -> str:
    """The canonical name (float32 / bfloat16 / float16) of a dtype option; ValueError for anything else."""
    canonical = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if canonical not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
    return canonical


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (library messages often span several)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why a ``.safetensors`` file cannot be read, or None. Reading its header catches corrupt and truncated files
    (the header's offsets must cover the file exactly), and names the file, which safetensors' own errors do not."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return None
    except (SafetensorError, OSError) as e:
        return f"{path} is truncated or corrupt ({first_line(e)})"


def check_files(name_or_path: str | os.PathLike) -> None:
    """ModelLoadError (one line) for a missing local folder or a damaged ``*.safetensors`` file in it (hub ids are
    checked when they load). Cheap: headers only."""
    where = resolve(name_or_path)
    if Path(where).is_dir():
        for f in sorted(Path(where).glob("*.safetensors")):
            if problem := safetensors_problem(f):
                raise ModelLoadError(f"{problem}; download or rebuild the model")


def load_tokenizer(name_or_path: str | os.PathLike):
    from transformers import AutoTokenizer

    where = resolve(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(where)
    except Exception as e:  # OSError, JSONDecodeError, and the tokenizers library's bare Exception for bad files
        raise ModelLoadError(f"could not load a tokenizer from {where!r}: {first_line(e)}") from None


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_map(device_map: str | None) -> None:
    """ValueError (one line) for a ``device_map`` :func:`load_model` does not take, or one asked for under torchrun
    with several processes (each process would spread its own copy over all of the node's GPUs)."""
    if device_map is None:
        return
    if device_map not in DEVICE_MAPS:
        raise ValueError(f"--device-map {device_map!r}: use one of {', '.join(DEVICE_MAPS)}")
    from . import distributed

    if distributed.launched_world_size() > 1:
        raise ValueError("--device-map spreads one model over the node's GPUs; under torchrun each process takes "
                         "one GPU (--device cuda): use one or the other")


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype | str | None = None, device: str = "cpu",
               attn_implementation: str | None = None, device_map: str | None = None):
    """Load a causal LM in eval mode. ``dtype=None`` keeps float32 on CPU and bfloat16 on CUDA.
    ``attn_implementation=None`` lets transformers choose: SDPA where the model supports it, else its eager attention
    (GPT-OSS: its attention sinks are not expressible in SDPA).

    ``device_map`` (``auto``, ``balanced``, ``balanced_low_0``, ``sequential``; accelerate's strategies) places the
    layers across the machine's GPUs instead of moving the model to ``device`` (ignored then): a model larger than
    one GPU. Without GPUs everything lands on the CPU. ``dtype=None`` is then bfloat16 if CUDA is available. Inputs
    go to ``model.device``, the device of its first parameter (the input embedding); accelerate's hooks move the
    activations between layers and return the outputs on the inputs' device.

    Raises :class:`ModelLoadError` (one line) for a missing, corrupt or truncated checkpoint, and for one that lacks
    weights or holds weights of the wrong shape (transformers would initialise those randomly, or fail after a
    multi-line report).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    check_device_map(device_map)
    where = resolve(name_or_path)
    if dtype is None:
        cuda = str(device).startswith("cuda") if device_map is None else torch.cuda.is_available()
        dtype = torch.bfloat16 if cuda else torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES[dtype_name(dtype)]
    check_files(where)
    # transformers logs a multi-line load report before failing on a bad checkpoint; hold it back, say what is
    # wrong in one line, and let the report through only when the load stands (e.g. it lists unused weights).
    report_logger, held = logging.getLogger("transformers.modeling_utils"), []

    def hold(record) -> bool:
        if "LOAD REPORT" in str(record.msg):
            held.append(record)
            return False
        return True

    report_logger.addFilter(hold)
    try:
        placement = {} if device_map is None else {"device_map": device_map}
        model, info = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=attn_implementation,
                                                           output_loading_info=True, ignore_mismatched_sizes=True,
                                                           **placement)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise ModelLoadError(f"could not load a model from {where!r}: {first_line(e)}") from None
    finally:
        report_logger.removeFilter(hold)
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(k[0] for k in info.get("mismatched_keys") or [])
    for keys, what in ((missing, "lacks"), (mismatched, "holds wrongly shaped")):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise ModelLoadError(f"the checkpoint in {where!r} {what} weights for {', '.join(keys[:3])}{more}: "
                                 "incomplete, or not the checkpoint of this config.json")
    for record in held:
        report_logger.handle(record)
    return (model if device_map is not None else model.to(device)).eval()


@dataclass
class ModelPair:
    """A target, the model that drafts for it (the same object for self-speculation) and their tokenizer."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    self_speculative: bool


def check_architecture(name_or_path: str | os.PathLike) -> None:
    """UnsupportedModelError (one line) for a model whose cache layers rift-ada cannot handle, read from its
    config alone, so an unsupported model is refused before its weights load."""
    from transformers import AutoConfig

    from .architectures import layer_kinds

    where = resolve(name_or_path)
    try:
        config = AutoConfig.from_pretrained(where)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not read a model config from {where!r}: {first_line(e)}") from None
    layer_kinds(config)


def load_pair(target: str = "testbed", drafter: str = "testbed", device: str = "cpu", dtype=None,
              device_map: str | None = None) -> ModelPair:
    """``drafter``: ``self`` (the target drafts for itself), a registered name ``NAME`` whose ``NAME-draft`` is
    registered too (``testbed``: the shipped draft, ``testbed-lm``: the trained draft alone), or any model name, path
    or hub id.
    ``device_map="auto"`` spreads each model over the machine's GPUs (:func:`load_model`); the draft is placed after
    the target, in the memory the target left."""
    check_device_map(device_map)
    drafter_name = target if drafter == "self" else drafter_model(drafter)
    check_files(target)
    check_files(drafter_name)  # a damaged draft fails before the target loads
    check_architecture(target)
    check_architecture(drafter_name)
    tok = load_tokenizer(target)
    tgt = load_model(target, dtype=dtype, device=device, device_map=device_map)
    if drafter == "self":
        return ModelPair(tgt, tgt, tok, True)
    drf = load_model(drafter_name, dtype=dtype, device=device, device_map=device_map)
    check_vocab(tgt, drf)
    return ModelPair(tgt, drf, tok, False)


def drafter_model(drafter: str) -> str:
    """The model a ``--drafter`` name loads: ``NAME-draft`` for a registered ``NAME`` that has one (``testbed`` ->
    ``testbed-draft``), else the name itself."""
    paired = f"{drafter}-draft"
    return paired if drafter in model_sources() and paired in model_sources() else drafter


def check_vocab(target, draft) -> None:
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(f"the drafter's vocabulary ({vd} tokens) differs from the target's ({vt}): draft and "
                         "target must share a tokenizer")


@torch.inference_mode()
def greedy_reference(model, prompt_ids: list[int], new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """The model's own greedy output via HF ``generate``: what every greedy speculative run must reproduce."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0,
                         top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()


ASSISTANT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def assisted_reference(target, draft, prompt_ids: list[int], new_tokens: int, draft_length: int | None = None,
                       eos_token_id: int | None = None) -> list[int]:
    """HF assisted generation (``generate(assistant_model=draft)``), greedy. ``draft_length=k``: exactly k draft
    tokens a round and no confidence stop, the setting of rift-ada's loop; None: HF's defaults (20 draft tokens, a
    round's drafting stops once the draft's top probability falls below 0.4).

    These settings are read from the *assistant's* ``generation_config``: given to ``target.generate`` they are
    silently ignored. They are set on the draft for the call and put back afterwards."""
    cfg = draft.generation_config
    saved = {a: getattr(cfg, a, None) for a in ASSISTANT_SETTINGS}
    if draft_length is not None:
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = draft_length, "constant"
        cfg.assistant_confidence_threshold = 0.0  # 0 disables the confidence stop
    ids = torch.tensor([prompt_ids], device=target.device)
    try:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                              max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos_token_id,
                              pad_token_id=eos_token_id if eos_token_id is not None else 0, top_p=None, top_k=None,
                              temperature=None)
    finally:
        for a, v in saved.items():
            setattr(cfg, a, v)
    return out[0, len(prompt_ids):].tolist()


def check_fits(model, n_tokens: int, what: str = "prompt + generation") -> None:
    """ValueError (one line) when ``n_tokens`` positions exceed the model's context."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and n_tokens > limit:
        raise ValueError(f"{what} needs {n_tokens} positions but the model's context is {limit} tokens; "
                         "use shorter prompts or fewer new tokens")
