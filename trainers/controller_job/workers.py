"""The main job's units in worker processes: one decoding thread per core instead of one in all.

A round of speculative decoding on the testbed keeps one core busy, and more torch threads barely help such small
forwards, so on a machine with several cores the units (one tradeoff point, one table) run
in ``--workers`` processes, each holding its own copy of the pair (loaded once per worker). Every unit is
deterministic given its inputs (seeded decoders), so the stored results are those one process would store, in any
order; each is stored as it finishes, so ``--resume`` works as before.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from tqdm.auto import tqdm


@dataclass(frozen=True)
class Setting:
    """What a worker needs to build the job's decoders: the pair's names and the decoder settings."""

    target: str
    drafter: str
    device: str
    dtype: str | None
    threads: int
    decoding: object  # rift_ada.speculative.Decoding


class Context:
    """The loaded pair and the decoders built on it (one per layout), in the job's process or in a worker."""

    def __init__(self, pair, decoding):
        self.pair, self.decoding, self._decoders = pair, decoding, {}

    def decoder(self, layout):
        from rift_ada.speculative import SpeculativeDecoder

        if layout not in self._decoders:
            self._decoders[layout] = SpeculativeDecoder.for_pair(self.pair, layout, self.decoding)
        return self._decoders[layout]


_WORKER: Context | None = None


def _start(setting: Setting) -> None:
    global _WORKER
    import torch
    from transformers.utils import logging as hf_logging

    from rift_ada.models import load_pair

    hf_logging.disable_progress_bar()  # one bar per worker would interleave with the job's
    torch.set_num_threads(setting.threads)
    _WORKER = Context(load_pair(setting.target, setting.drafter, device=setting.device, dtype=setting.dtype),
                      setting.decoding)


def _run(fn, args) -> tuple[dict, float]:
    t0 = time.time()
    return fn(_WORKER, *args), time.time() - t0


def run_units(state, units: list[tuple[str, object, tuple]], context: Context, setting: Setting, workers: int,
              desc: str, first=()) -> list[dict]:
    """The stored result of each unit ``(name, fn, args)``, ``fn(context, *args)`` computing it (a JSON-able dict;
    ``fn`` a module-level function, so a worker can unpickle it). Units finished before are loaded; the rest run
    here (``workers`` 1) or in a pool of worker processes, each stored as it finishes; the units named in ``first``
    (the longest, such as the oracle's) start first, so no worker is left with them at the end."""
    todo = sorted([(name, fn, args) for name, fn, args in units if not state.has(name)],
                  key=lambda u: u[0] not in first)
    bar = tqdm(total=len(units), initial=len(units) - len(todo), desc=desc)
    if workers <= 1 or len(todo) <= 1:
        for name, fn, args in todo:
            state.unit(name, lambda fn=fn, args=args: fn(context, *args))
            bar.update()
    elif todo:
        ctx = multiprocessing.get_context("forkserver")
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx, initializer=_start,
                                 initargs=(setting,)) as pool:
            futures = {pool.submit(_run, fn, args): name for name, fn, args in todo}
            for fut in as_completed(futures):
                result, seconds = fut.result()
                state.store(futures[fut], result, seconds)
                bar.update()
    bar.close()
    return [state.load(name) for name, _, _ in units]
