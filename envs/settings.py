"""The keywords an environment made by name is built from: models, prompts, lengths, cache and sampling, each a plain
value, so ``gymnasium.make(id, **kwargs)``, ``gymnasium.make_vec`` and a config file can give them.

:class:`Setup` holds them with the built-in testbed's defaults (the main job's settings, on a small prompt set), and
checks each one, failing in one line that names the keyword. ``RefreshEnv`` builds its decoder and prompts from it;
``ReplayEnv`` and ``JointReplayEnv`` the replay tables they replay (``rift_ada.envs.tables``), so an agent trained
on the replay envs made by name meets the same pair, prompts and cache in ``rift_ada/Refresh-v0``.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Setup:
    """The build keywords with their defaults; :meth:`of` checks given ones. One setting serves the live env (its
    decoder and prompts) and the replay envs (the tables' models, prompts and cache)."""

    target: str = "testbed"  # a registered name, a local HuggingFace folder or a hub id
    drafter: str = "testbed"  # as --drafter: "self", a name whose NAME-draft is registered, or any model
    # How many prompts to build (cycling through ``task``'s families), or the prompts themselves: strings, or token
    # ids (lists of ints).
    prompts: int | tuple = 3
    task: str = "low,sort,high"  # the task families, as --task
    source_dir: str | None = None  # a code base (a folder or an installed package); None: the stdlib's training split
    input_tokens: int = 1024  # built prompts' length
    max_new_tokens: int = 256  # tokens generated per episode
    budget: int = 256  # the draft cache's budget (a quarter of the prompt, as in the main job)
    refresh_grid: int = 8  # a refresh scores the history as of the last multiple of this many generated tokens
    draft_length: int = 11  # k
    temperature: float = 1.0  # 0: greedy
    seed: int = 0  # prompt building and the sampled continuations of tables; episodes follow reset(seed=...)
    device: str = "cpu"
    dtype: str | None = None  # None: the models' own

    @classmethod
    def of(cls, owner: str, given: dict) -> "Setup":
        """A Setup from the ``given`` keywords (a None value: the default), checked; ``owner`` names the env in
        errors."""
        given = {k: v for k, v in given.items() if v is not None}
        setup = replace(cls(), **given)
        setup.check(owner)
        if not _is_int(setup.prompts):
            for_built = sorted({"task", "source_dir", "input_tokens"} & set(given))
            if for_built:
                raise ValueError(f"{owner}: {', '.join(for_built)} only shape{'s' if len(for_built) == 1 else ''} "
                                 "built prompts (prompts=N); the prompts given are used as they are")
        # One spelling per value (1 and 1.0, numpy and Python ints), so equal settings name the same cached tables.
        return replace(setup, prompts=int(setup.prompts) if _is_int(setup.prompts) else _frozen(setup.prompts),
                       temperature=float(setup.temperature), seed=int(setup.seed),
                       **{k: int(getattr(setup, k)) for k in ("input_tokens", "max_new_tokens", "budget",
                                                              "refresh_grid", "draft_length")})

    def check(self, owner: str) -> None:
        """ValueError / TypeError in one line naming the keyword and what it accepts."""
        for name in ("target", "drafter", "task", "device"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise TypeError(f"{owner}: {name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("input_tokens", "max_new_tokens", "budget", "refresh_grid", "draft_length"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
        if not _is_int(self.seed):
            raise ValueError(f"{owner}: seed must be an integer, got {self.seed!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) \
                or not 0 <= self.temperature < math.inf:
            raise ValueError(f"{owner}: temperature must be a number >= 0 (0: greedy), got {self.temperature!r}")
        _check_prompts(owner, self.prompts)
        from rift_ada.data import TASK_FAMILIES
        from rift_ada.data.tasks import task_mix

        bad = [f for f in task_mix(self.task) if f not in TASK_FAMILIES]
        if bad or not task_mix(self.task):
            raise ValueError(f"{owner}: task must be one of {', '.join(TASK_FAMILIES)} or a comma-separated mix, got "
                             f"{self.task!r}")
        if self.source_dir is not None:
            if not isinstance(self.source_dir, (str, os.PathLike)):
                raise TypeError(f"{owner}: source_dir must be a folder or an installed package's name, got "
                                f"{self.source_dir!r}")
            from rift_ada.data.sources import source_folder

            try:
                source_folder(str(self.source_dir))
            except ValueError as e:
                raise ValueError(f"{owner}: source_dir: {e}") from None
        if self.dtype is not None:
            from rift_ada.models import dtype_name

            try:
                dtype_name(self.dtype)
            except ValueError as e:
                raise ValueError(f"{owner}: dtype: {e}") from None

    @property
    def builds_prompts(self) -> bool:
        return _is_int(self.prompts)

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """The prompts as token ids: built (``prompts`` of ``task``'s families, ``input_tokens`` long, the stdlib's
        training split or all of ``source_dir``), encoded, or as given."""
        if self.builds_prompts:
            return [list(p) for p in _built_prompts(tokenizer, self.task, self.prompts, self.input_tokens, self.seed,
                                                     None if self.source_dir is None else str(self.source_dir))]
        if isinstance(self.prompts[0], str):
            from rift_ada.data import encode

            return [encode(tokenizer, p) for p in self.prompts]
        return [list(p) for p in self.prompts]

    def layout(self):
        """The draft cache: a rift layout that refreshes (``--policy rift-ada`` with this budget and grid)."""
        from rift_ada.policies import make_policy

        return make_policy("rift-ada", self.budget, controller="never", refresh_grid=self.refresh_grid).layout

    def decoding(self, **overrides):
        from rift_ada.speculative import Decoding

        return Decoding(**{"draft_length": self.draft_length, "temperature": float(self.temperature),
                           "seed": int(self.seed), **overrides})

    @property
    def draft_model(self) -> str:
        """The draft's model name (``drafter`` resolved as ``load_pair`` does)."""
        from rift_ada.models import drafter_model

        return self.target if self.drafter == "self" else drafter_model(self.drafter)

    def pair(self, owner: str = "the env"):
        """The models, loaded once per process (every env of a vector env shares them)."""
        resolved(owner, "target", self.target)
        resolved(owner, "drafter", self.draft_model)
        return shared_pair(self.target, self.drafter, self.device, self.dtype)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["source_dir"] = None if self.source_dir is None else str(self.source_dir)
        d["prompts"] = self.prompts if _is_int(self.prompts) else [
            p if isinstance(p, str) else list(p) for p in self.prompts]
        return d


KEYWORDS = tuple(f.name for f in fields(Setup))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_prompts(owner: str, prompts) -> None:
    accepted = "a number of prompts to build (>= 1), a list of strings, or a list of token-id lists"
    if _is_int(prompts):
        if prompts < 1:
            raise ValueError(f"{owner}: prompts must be {accepted}, got {prompts!r}")
        return
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError(f"{owner}: prompts must be {accepted}, got {_short(prompts)}")
    if all(isinstance(p, str) and p for p in prompts):
        return
    if all(not isinstance(p, (str, bytes)) and hasattr(p, "__len__") and len(p) > 0 and all(_is_int(t) for t in p)
           for p in prompts):
        return
    raise ValueError(f"{owner}: prompts must be {accepted} (not mixed, none empty), got {_short(prompts)}")


def _frozen(prompts) -> tuple:
    return tuple(p if isinstance(p, str) else tuple(int(t) for t in p) for p in prompts)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def take_keywords(cls, given: dict, allowed) -> dict:
    """``given`` (an env's ``**build``) if every keyword is in ``allowed``; else TypeError in one line naming the
    first stray one, the closest it accepts and all of them (``cls.__init__``'s own parameters and ``allowed``)."""
    stray = sorted(set(given) - set(allowed))
    if not stray:
        return given
    params = [p.name for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    accepted = params + [k for k in allowed if k not in params]
    close = difflib.get_close_matches(stray[0], accepted, n=1, cutoff=0.7)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TypeError(f"{cls.__name__} got an unexpected keyword {stray[0]!r}{hint}; it accepts: {', '.join(accepted)}")


def resolved(owner: str, keyword: str, name: str) -> str:
    """``rift_ada.models.resolve(name)`` (the testbed's names compose the pair on first use); its one-line refusal
    names the keyword."""
    from rift_ada.models import ModelLoadError, resolve

    try:
        return resolve(name)
    except ModelLoadError as e:
        raise ValueError(f"{owner}: {keyword}: {e}") from None


@lru_cache(maxsize=4)
def shared_pair(target: str, drafter: str, device: str, dtype: str | None):
    """``rift_ada.models.load_pair``, once per process and settings: every env of a process shares the models."""
    from rift_ada.models import load_pair

    return load_pair(target, drafter, device=device, dtype=dtype)


@lru_cache(maxsize=8)
def _built_prompts(tokenizer, task: str, n: int, input_tokens: int, seed: int, source_dir: str | None) -> tuple:
    from rift_ada.data import build_task_mix, encode
    from rift_ada.data.sources import source_folder

    source = None if source_dir in (None, "stdlib") else source_folder(source_dir)
    tasks = build_task_mix(tokenizer, task, n, input_tokens, seed, "train" if source is None else None,
                           source_dir=source)
    return tuple(tuple(encode(tokenizer, t.prompt)) for t in tasks)


def corpus_stamp(source_dir) -> dict:
    """What the built prompts depend on besides the settings: the stdlib's interpreter, or the code base's folder, its
    Python files and their newest change."""
    import sys

    from rift_ada.data.corpus import stdlib_dir
    from rift_ada.data.sources import source_folder

    folder = None if source_dir in (None, "stdlib") else source_folder(str(source_dir))
    if folder is None:
        return {"stdlib": str(stdlib_dir()), "python": sys.version}
    stats = [p.stat() for p in Path(folder).rglob("*.py")
             if "site-packages" not in p.relative_to(folder).parts and p.is_file()]  # as load_corpus reads it
    return {"folder": str(Path(folder).resolve()), "files": len(stats),
            "newest": max((s.st_mtime_ns for s in stats), default=0)}
