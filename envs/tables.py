"""Where a replay env's tables come from: given (tables, table files or a folder of them), or built on first use for
the env's :class:`~rift_ada.envs.settings.Setup` and kept in the cache folder beside the composed testbed pair
(``rift_ada.files.cache_root``: ``$RIFT_ADA_CACHE``, else ``~/.cache/rift_ada``).

A built set lives in ``replay-tables-<key>/``, the key a hash of the settings and of what the tables depend on
besides them (the models' folders and files, the prompts' code base, torch, the table format), so changing any of
them builds a new set. Each table is written whole or not at all (``ReplayTable.save``) and the set's manifest last,
under a lock: concurrent processes (pytest workers, SubprocVecEnv workers) build it once, and a reader trusts only a
set whose manifest is written. An interrupted build resumes with the tables it finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from functools import lru_cache
from pathlib import Path

from rift_ada.replay.table import ReplayTable

from .settings import Setup, corpus_stamp, resolved

# The keywords that say how the tables are built (Setup's, less the env's own draft length).
BUILD_KEYWORDS = ("target", "drafter", "prompts", "task", "source_dir", "input_tokens", "max_new_tokens", "budget",
                  "refresh_grid", "temperature", "seed", "device", "dtype")
FORMAT = "rift-ada/env-tables-v1"
MANIFEST = "tables.json"
BUILD_DRAFT_LENGTH = 11  # the continuation's drafts: a table holds every position, whatever k replays it


def env_tables(owner: str, tables, build: dict) -> list[ReplayTable]:
    """The tables ``tables`` names, or (None) those ``build``'s keywords describe, built on first use."""
    if tables is None:
        return list(built_tables(Setup.of(owner, build), owner))
    given = sorted(k for k, v in build.items() if v is not None)
    if given:
        raise ValueError(f"{owner}: {', '.join(given)} only set{'s' if len(given) == 1 else ''} how the tables it "
                         "builds are made (tables=None); the tables given hold their own settings")
    return given_tables(owner, tables)


def given_tables(owner: str, tables) -> list[ReplayTable]:
    """ReplayTables, table files, or a folder of them (every ``*.safetensors`` in it, by name)."""
    accepted = "replay tables, table files, or a folder of them"
    if isinstance(tables, ReplayTable):
        return [tables]
    if isinstance(tables, (str, os.PathLike)):
        path = Path(tables).expanduser()
        if path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{owner}: tables: no replay tables (*.safetensors) in {path}")
            return [_load(owner, f) for f in files]
        return [_load(owner, path)]
    if isinstance(tables, bytes) or not hasattr(tables, "__iter__"):
        raise TypeError(f"{owner}: tables must be {accepted}, got {type(tables).__name__}")
    out = []
    for t in tables:
        if isinstance(t, ReplayTable):
            out.append(t)
        elif isinstance(t, (str, os.PathLike)):
            out.append(_load(owner, t))
        else:
            raise TypeError(f"{owner}: tables must be {accepted}, got a list holding {type(t).__name__}")
    return out


def _load(owner: str, path) -> ReplayTable:
    try:
        return ReplayTable.load(Path(path).expanduser())
    except ValueError as e:
        raise ValueError(f"{owner}: tables: {e}") from None


def built_tables(setup: Setup, owner: str = "the env") -> tuple[ReplayTable, ...]:
    """The tables of ``setup``'s prompts: loaded from the cache folder, or built there first (once per machine)."""
    from rift_ada.files import cache_root, locked

    folder = cache_root() / f"replay-tables-{table_key(setup, owner)}"
    if not (folder / MANIFEST).is_file():
        with locked(cache_root() / f".{folder.name}.lock"):
            if not (folder / MANIFEST).is_file():  # another process may have built it while this one waited
                build(setup, folder, owner)
    return _load_set(str(folder), (folder / MANIFEST).stat().st_mtime_ns)


@lru_cache(maxsize=8)
def _load_set(folder: str, stamp: int) -> tuple[ReplayTable, ...]:
    """A built set, once per process (every env of a vector env replays the same read-only arrays)."""
    names = json.loads((Path(folder) / MANIFEST).read_text())["tables"]
    return tuple(ReplayTable.load(Path(folder) / name) for name in names)


def table_key(setup: Setup, owner: str = "the env") -> str:
    """A hash of what the tables of ``setup`` depend on."""
    import torch

    from rift_ada.replay.table import FORMAT as TABLE_FORMAT

    settings = setup.as_dict()
    del settings["draft_length"]
    key = {"format": FORMAT, "table_format": TABLE_FORMAT, "torch": torch.__version__, "settings": settings,
           "target": model_stamp(owner, "target", setup.target),
           "drafter": model_stamp(owner, "drafter", setup.draft_model)}
    if setup.builds_prompts:
        key["corpus"] = corpus_stamp(setup.source_dir)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def model_stamp(owner: str, keyword: str, name: str) -> dict:
    """Which model ``name`` is: its folder and its config and weight files (size, change time); a hub id as given
    (a new revision under the same id is not noticed: delete the set's folder to rebuild)."""
    path = Path(resolved(owner, keyword, name))
    if not path.is_dir():
        return {"hub": str(name)}
    files = sorted(p for p in path.iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
    return {"folder": str(path.resolve()), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def build(setup: Setup, folder: Path, owner: str = "the env") -> None:
    """Build ``setup``'s tables into ``folder``, then its manifest."""
    from rift_ada.files import write_json
    from rift_ada.models import check_fits
    from rift_ada.replay.build import Builder, TableSpec, build_tables, check_layout

    t0 = time.perf_counter()
    size = f"{setup.prompts} prompts" if setup.builds_prompts else f"{len(setup.prompts)} prompts"
    print(f"rift_ada.envs: building the replay tables of {owner} once ({size}, {setup.max_new_tokens} new tokens each; "
          f"the default set takes about a minute on 2 cores) into {folder}", file=sys.stderr)
    pair = setup.pair(owner)
    prompts = setup.prompt_ids(pair.tokenizer)
    layout = setup.layout()
    for ids in prompts:
        try:
            check_layout(layout, len(ids))
        except ValueError as e:
            raise ValueError(f"{owner}: budget: {e}") from None
        for model in (pair.target, pair.draft):
            check_fits(model, len(ids) + setup.max_new_tokens, f"{owner}: a prompt + max_new_tokens")
    specs = [TableSpec(f"table-{i:03d}", tuple(ids), int(setup.seed)) for i, ids in enumerate(prompts)]
    decoding = setup.decoding(draft_length=BUILD_DRAFT_LENGTH)
    builder = Builder(setup.target, setup.drafter, layout, decoding, setup.max_new_tokens, setup.device,
                      setup.dtype)
    paths = build_tables(builder, specs, folder, pair, progress="replay tables (first use)")
    write_json(folder / MANIFEST, {"format": FORMAT, "settings": setup.as_dict(), "tables": [p.name for p in paths],
                                   "build_seconds": round(time.perf_counter() - t0, 1)})
