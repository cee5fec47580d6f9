"""Several RefreshEnvs stepping together: in one process (SB3 ``DummyVecEnv``) or one process each
(``SubprocVecEnv``).

A subprocess needs models of its own. Handing it a closure over loaded models would pickle their weights into every
worker; :class:`RefreshEnvSpec` instead names the pair (``"testbed"``, a folder or a hub id) and the decoder's
settings, and each worker loads the pair once (``load_pair`` is cached per process), so the same spec serves
``DummyVecEnv`` (one shared copy) and ``SubprocVecEnv`` (one copy per worker).

    specs = [RefreshEnvSpec(prompts=ids, layout=layout, seed=i) for i in range(4)]
    venv = make_vec_env(specs, subproc=True)       # 4 workers, each with its own models

Decoding is deterministic per env seed (SB3 seeds env i with seed + i), so a subprocess run steps through the same
trajectories as the single-process one. On a machine with few cores, more workers than cores only add copies of the
models: ``experiments/bench_env.py`` measures steps per second for each choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rift_ada.costs import CostModel
from rift_ada.layout import CacheLayout

from .refresh_env import RefreshEnv
from .settings import shared_pair  # noqa: F401  (experiments/bench_env.py loads the pair through it)


@dataclass(frozen=True)
class RefreshEnvSpec:
    """Everything a RefreshEnv needs, by name and value (picklable, no weights): calling it builds the env."""

    prompts: Sequence[Sequence[int]]
    layout: CacheLayout
    target: str = "testbed"
    drafter: str = "testbed"
    device: str = "cpu"
    dtype: str | None = None
    draft_length: int = 11
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0  # the decoder's initial seed; reset() re-seeds it from the env's seed
    max_new_tokens: int = 256
    lam: float = 1.0
    refresh_cost: float = 2.0
    reward: str = "tokens"
    costs: CostModel | None = None
    threads: int | None = field(default=1)  # torch threads in a worker (None: leave torch's setting)

    def __call__(self) -> RefreshEnv:
        from rift_ada.speculative import Decoding, SpeculativeDecoder

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        pair = shared_pair(self.target, self.drafter, self.device, self.dtype)
        decoding = Decoding(self.draft_length, self.temperature, self.top_p, self.seed)
        decoder = SpeculativeDecoder.for_pair(pair, self.layout, decoding)
        return RefreshEnv(decoder, [list(p) for p in self.prompts], self.max_new_tokens, lam=self.lam,
                          refresh_cost=self.refresh_cost, reward=self.reward, costs=self.costs)


def make_vec_env(env_fns, subproc: bool = False, start_method: str = "forkserver"):
    """A VecEnv over ``env_fns`` (callables making RefreshEnvs; :class:`RefreshEnvSpec` for ``subproc=True``).
    ``subproc``: one worker process per env (``forkserver``: a fresh interpreter, so no torch thread pool or
    loaded model is inherited through fork)."""
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    if not env_fns:
        raise ValueError("make_vec_env needs at least one env")
    if subproc:
        bad = [type(f).__name__ for f in env_fns if not isinstance(f, RefreshEnvSpec)]
        if bad:
            raise ValueError(f"subprocess envs need RefreshEnvSpec factories (they load their own models), got "
                             f"{', '.join(sorted(set(bad)))}")
        return SubprocVecEnv(list(env_fns), start_method=start_method)
    return DummyVecEnv(list(env_fns))
