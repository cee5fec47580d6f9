"""Running vLLM for experiments/bench_vllm.py and the suite's vLLM tests: an engine per drafting method, a schedule
of requests that arrive and finish at different steps (continuous batching), and what each request saw.

Every request's acceptance length is read off the engine's own steps: in one ``LLMEngine.step`` every running
request verifies once, so the tokens it gained after its first one, over the steps that gained any, is its tokens per
verify round (rift-ada's AL). Nothing here reads vLLM's internals or its process-global Prometheus counters.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

# vLLM's CPU build, on 2 cores beside other work: one OpenMP thread, no core pinning, a small KV pool (GiB); set
# before vLLM is imported (its workers read them at start).
# SETUPTOOLS_USE_DISTUTILS: vLLM imports setuptools (through torch's cpp_extension), whose distutils shim fails an
# assertion once the standard library's distutils was imported (as the model-loading imports do).
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
              "SETUPTOOLS_USE_DISTUTILS": "stdlib"}
METHODS = ("plain", "draft_model", "rift")


def set_engine_env() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrive: int = 0  # the engine step at which it is added


@dataclass
class Served:
    """One request as the engine served it."""

    tokens: list[int]
    rounds: int = 0  # steps after the first token that gave it tokens (verify rounds)


@dataclass
class Run:
    served: list[Served]
    seconds: float  # from the first request's arrival to the last one's end (start-up excluded)
    steps: int
    stats: dict = field(default_factory=dict)  # the RIFT proposer's counters (rift_ada.proposer.PoolStats)

    @property
    def acceptance_length(self) -> float:
        rounds = sum(s.rounds for s in self.served)
        return sum(len(s.tokens) - 1 for s in self.served) / rounds if rounds else 0.0


def make_llm(target: str, method: str, draft: str | None = None, k: int = 11, max_model_len: int = 4096,
             max_num_seqs: int = 8, **rift):
    """A vLLM engine of ``target`` (float32, eager) drafting by ``method``: ``plain`` (none), ``draft_model``
    (vLLM's own: the draft's full KV in the target's paged pool) or ``rift`` (``RiftProposer`` with the ``rift``
    settings, ``draft`` its model)."""
    set_engine_env()
    from vllm import LLM

    from ..vllm_proposer import speculative_kwargs

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    extra = {}
    if method == "draft_model":
        extra["speculative_config"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    elif method == "rift":
        extra = speculative_kwargs(k, draft=draft, **rift)
    return LLM(model=target, enforce_eager=True, dtype="float32", max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_model_len, 8192), seed=0, **extra)


def run_schedule(llm, requests: list[Request], stats_file: str | None = None) -> Run:
    """Greedy decoding of ``requests`` through ``llm``'s engine, each added at its step, stepping until all end."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    served = [Served([]) for _ in requests]
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrive)
    step, start = 0, time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]].arrive <= step:
            i = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": requests[i].prompt},
                               SamplingParams(max_tokens=requests[i].max_tokens, temperature=0.0, ignore_eos=True))
        for out in engine.step():
            s = served[int(out.request_id)]
            tokens = list(out.outputs[0].token_ids)
            if len(tokens) > len(s.tokens):
                s.rounds += bool(s.tokens)  # the first token comes from the prefill, not a verify round
                s.tokens = tokens
        step += 1
    seconds = time.perf_counter() - start
    stats = json.loads(Path(stats_file).read_text()) if stats_file and Path(stats_file).exists() else {}
    return Run(served, seconds, step, stats)


def close(llm) -> None:
    """Shut the engine down and free its pool before the next one starts (two pools at once would not fit)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


# --- the bench (experiments/bench_vllm.py) ---------------------------------------------------------------------------
def long_context_folder(name: str, max_len: int) -> str:
    """``name``'s folder, or, when its ``max_position_embeddings`` is below ``max_len``, a copy in rift-ada's cache
    whose config says ``max_len`` (weights and tokenizer linked, not copied): vLLM refuses a context longer than the
    config's. The model was trained shorter, so beyond that its text is out of distribution; what a bench reads there
    is memory, time and losslessness, not quality."""
    from ..files import cache_root
    from ..models import resolve

    src = Path(resolve(name))
    config = json.loads((src / "config.json").read_text())
    if config.get("max_position_embeddings", 0) >= max_len:
        return str(src)
    dst = cache_root() / f"{src.name}-ctx{max_len}"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    config["max_position_embeddings"] = max_len
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst)


def draft_kv_bytes(method: str, run: Run, draft_folder: str, requests: list[Request]) -> int:
    """The draft's KV at its largest: RIFT's measured peak over its live requests' caches; for ``draft_model`` the
    pool capacity its layers take (every live token of every request, keys and values, float32: what vLLM allocates
    to the draft's layers in the shared pool); 0 without a draft."""
    if method == "plain":
        return 0
    if method != "draft_model":
        return int(run.stats.get("peak_active_bytes", 0))
    from transformers import AutoConfig

    from ..batch import kv_bytes_per_token

    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(draft_folder), 4)
    return per_token * sum(len(r.prompt) + r.max_tokens for r in requests)


def bench_method(target: str, draft: str, method: str, rift: dict, batches: list[list[Request]], max_len: int,
                 k: int, stats_dir: Path) -> list[dict]:
    """One engine, every batch in turn: tokens/s, AL, the draft's KV and refreshes per 1K tokens, and the outputs
    (for the losslessness check against ``plain``)."""
    stats = str(stats_dir / f"stats-{method}-{rift.get('policy', '')}.json") if method == "rift" else None
    settings = dict(rift, stats_file=stats) if method == "rift" else {}
    llm = make_llm(target, method, draft, k, max_model_len=max_len, max_num_seqs=max(len(b) for b in batches),
                   **settings)
    rows = []
    try:
        run_schedule(llm, [Request(batches[0][0].prompt[:64], 8)], stats)  # warm-up: first-call costs
        for requests in batches:
            if stats and Path(stats).exists():
                Path(stats).unlink()
            run = run_schedule(llm, requests, stats)
            generated = sum(len(s.tokens) - 1 for s in run.served)
            rows.append({"rows": len(requests), "tokens_per_s": generated / run.seconds,
                         "acceptance_length": run.acceptance_length, "steps": run.steps,
                         "draft_kv_bytes": draft_kv_bytes(method, run, draft, requests),
                         "refreshes_per_1k": run.stats.get("refreshes_per_1k", 0.0),
                         "seconds": run.seconds, "draft_seconds": run.stats.get("seconds", 0.0),
                         "draft_prefill_seconds": run.stats.get("prefill_seconds", 0.0),
                         "outputs": [s.tokens for s in run.served]})
    finally:
        close(llm)
    return rows
