"""Resumable jobs: finished units of work persisted as small files under ``<output-dir>/state`` (or kept in memory,
for a script that does not resume: the same :class:`RunState`, without a folder). The project's one implementation of
"a unit of work done once": the controller job, the compressibility trainer and the scripts all use it.

A unit (one fit, one PPO run, one sweep point, ...) is deterministic given its inputs, so a
resumed job that loads finished units and recomputes the rest ends exactly where an uninterrupted job does. Every
file is written to a temporary name and moved into place (``os.replace`` is atomic), so a kill leaves either the
whole file or none; a unit that was interrupted is simply redone.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from rift_ada.files import atomic_write, write_json  # noqa: F401  (re-exported: the jobs' one writer)

STATE = "state"


def config_of(args, ignore=()) -> dict:
    """The settings that define a run's results, as JSON would store them (tuples become lists)."""
    return json.loads(json.dumps({k: v for k, v in sorted(vars(args).items()) if k not in ignore}))


class RunState:
    """The finished units of one job, in ``folder`` (``<output-dir>/state``); ``folder=None`` keeps them in memory.

    ``collective``: under torchrun every process holds one and calls its :meth:`unit` and :meth:`check_config` alike;
    rank 0 alone reads and writes ``folder`` and the others learn its answers (a single process: as without)."""

    def __init__(self, folder: str | Path | None = None, collective: bool = False):
        self.collective, self.main = False, True
        if collective:
            from . import distributed

            self.collective, self.main = distributed.world_size() > 1, distributed.is_main()
        # The other processes of a collective state hold no folder: they never touch its files.
        self.folder = None if folder is None or not self.main else Path(folder)
        self.memory: dict[str, str] = {}  # name -> the JSON a folder would hold: both paths return parsed JSON
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        if self.folder is None:
            raise ValueError("an in-memory RunState has no files")
        return self.folder / name

    def has(self, name: str) -> bool:
        return self._read(name) is not None

    def _read(self, name: str) -> str | None:
        if self.folder is None:
            return self.memory.get(name)
        path = self.folder / f"{name}.json"
        return path.read_text() if path.is_file() else None

    def unit(self, name: str, compute, key=None) -> dict:
        """The result of unit ``name``: loaded when finished before (with the same ``key``, if given), otherwise
        ``compute()`` (a JSON-able dict), timed and stored. Both paths return the stored JSON, so an uninterrupted
        and a resumed job go on with bit-identical values.

        Collective (under torchrun): rank 0 says whether the unit is stored; if not, every process computes it
        (``compute`` may itself be collective, as ``rift_ada.evaluate.evaluate`` is) and rank 0 stores it. Every
        process returns rank 0's value."""
        stored = self._shared(lambda: self.load(name, key))
        if stored is not None:
            return stored
        t0 = time.time()
        result = compute()
        return self._shared(lambda: self.store(name, result, time.time() - t0, key))

    def _shared(self, fn):
        """``fn()`` on rank 0 of a collective state, its value on every process; ``fn()`` otherwise."""
        if not self.collective:
            return fn()
        from . import distributed

        return distributed.broadcast(fn() if self.main else None)

    def load(self, name: str, key=None) -> dict | None:
        """Unit ``name`` as stored (with the same ``key``, if given), or None: what :meth:`unit` would load."""
        text = self._read(name)
        if text is not None:
            stored = json.loads(text)
            if key is None or stored.get("key") == json.loads(json.dumps(key)):
                return stored
        return None

    def store(self, name: str, result: dict, seconds: float, key=None) -> dict:
        """Store a unit's ``result`` (computed in ``seconds``) and return it as stored: what :meth:`unit` stores."""
        result = {**result, "seconds": seconds}
        if key is not None:
            result["key"] = key
        if self.folder is None:
            self.memory[name] = json.dumps(result)
        else:
            write_json(self.folder / f"{name}.json", result)
        return json.loads(self._read(name))

    def started(self) -> bool:
        """Whether any work is stored (a config.json alone is a start that failed before doing any)."""
        if self.folder is None:
            return bool(self.memory)
        return any(p.name != "config.json" for p in self.folder.iterdir())

    def check_config(self, config: dict, hint: str) -> None:
        """Store ``config`` for a run that has not started; refuse (ValueError, one line) to continue a started run
        made with other settings (collective: on every process)."""
        problem = self._shared(lambda: self._config_problem(config, hint))
        if problem is not None:
            raise ValueError(problem)

    def _config_problem(self, config: dict, hint: str) -> str | None:
        path = self.folder / "config.json"
        if not self.started() or not path.is_file():
            write_json(path, config)
            return None
        old = json.loads(path.read_text())
        diff = [f"--{k.replace('_', '-')} {old.get(k)!r} -> {config.get(k)!r}" for k in sorted(set(old) | set(config))
                if old.get(k) != config.get(k)]
        return f"{self.folder.parent} holds a run made with other settings ({'; '.join(diff)}); {hint}" if diff else None


def open_state(out: Path, config: dict, resume: bool, overwrite: bool, outputs=()) -> RunState:
    """The state of the job writing to ``out``. A folder holding a previous run is refused unless ``resume`` (continue
    it; its settings must equal ``config``) or ``overwrite`` (delete its state and ``outputs``, keep W&B logs).
    Raises ValueError with a one-line message."""
    state = RunState(out / STATE)
    if overwrite:
        shutil.rmtree(state.folder)
        for o in outputs:
            (out / o).unlink(missing_ok=True)
        state = RunState(out / STATE)
    elif not resume and (state.started() or any((out / o).exists() for o in outputs)):
        raise ValueError(f"{out} holds a previous run: pass --resume to continue it, --overwrite to start over, or "
                         "choose another --output-dir")
    state.check_config(config, "resume with the same options, or pass --overwrite or another --output-dir")
    return state
