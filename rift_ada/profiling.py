"""Where a round's time goes: the models' forwards, the cache's rescoring, and the rest (the framework's overhead).

``profile_decode(decoder, prompt, max_new_tokens, controller)`` decodes one prompt like ``rift_ada.evaluate.decode``
(the decoder's own loop, ``SpeculativeDecoder.rounds``) and times the rounds from outside, while forward hooks on the
models time their forward calls (the caches' own updates run inside those calls and count as forward time).
Overhead = step time - forward time - refresh time: the sampling, acceptance, rollback bookkeeping, signals and Python
around the models.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


class ForwardClock:
    """Wall time spent inside the forward calls of some modules (synchronising CUDA at both ends)."""

    def __init__(self, *modules):
        self.seconds, self.calls, self._t, self._handles = 0.0, 0, [], []
        for m in {id(m): m for m in modules}.values():  # self-speculation passes one model twice
            self._handles.append(m.register_forward_pre_hook(self._start))
            self._handles.append(m.register_forward_hook(self._stop))

    @staticmethod
    def _sync(module):
        p = next(module.parameters(), None)
        if p is not None and p.device.type == "cuda":
            torch.cuda.synchronize(p.device)

    def _start(self, module, args):
        self._sync(module)
        self._t.append(time.perf_counter())

    def _stop(self, module, args, output):
        self._sync(module)
        self.seconds += time.perf_counter() - self._t.pop()
        self.calls += 1

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class DecodeProfile:
    tokens: list[int]
    seconds: float  # reset (prefill, compression) + every step
    step_seconds: float  # the rounds alone
    forward_seconds: float  # model forwards inside the rounds
    refresh_seconds: float  # rescoring inside the rounds
    forward_calls: int = 0  # model forwards inside the rounds (target and draft)

    @property
    def overhead_seconds(self) -> float:
        return max(self.step_seconds - self.forward_seconds - self.refresh_seconds, 0.0)

    @property
    def overhead_share(self) -> float:
        """Share of round time spent outside model forwards and rescoring."""
        return self.overhead_seconds / self.step_seconds if self.step_seconds else 0.0


def profile_decode(decoder, prompt, max_new_tokens: int, controller=None) -> DecodeProfile:
    from .refresh.base import refresh_wanted

    def now():
        if decoder.device.type == "cuda":
            torch.cuda.synchronize(decoder.device)
        return time.perf_counter()

    t0 = now()
    decoder.reset(prompt, max_new_tokens)
    t_steps = now()
    clock = ForwardClock(decoder.target, decoder.draft)
    try:
        for _ in decoder.rounds(lambda state: refresh_wanted(controller, state)):
            pass
    finally:
        clock.close()
    end = now()
    return DecodeProfile(decoder.result.tokens, end - t0, end - t_steps, clock.seconds,
                         sum(r.refresh_seconds for r in decoder.result.rounds), clock.calls)
