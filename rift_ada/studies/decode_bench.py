"""What the decode benchmarks (``experiments/bench_decode.py``, ``experiments/gpu_check.py``) share: their options, a
clock that waits for CUDA, the per-round averages of decode records, dynamo's graph count around a compile, HF
assisted generation in its two settings, and the greedy baselines they compare against.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def add_benchmark_options(parser: argparse.ArgumentParser, *, lengths: list[int] | None, lengths_help: str,
                          budget: int | None, budget_help: str | None, max_new_tokens: int, compile_help: str) -> None:
    """The options every decode benchmark takes: input lengths, the draft's budget and rift-dyn's period, k, the
    tokens per prompt, ``--compile`` and ``--output``. Each script checks their values itself (its limits differ)."""
    g = parser.add_argument_group("benchmark")
    g.add_argument("--lengths", type=int, nargs="+", default=lengths, help=lengths_help)
    g.add_argument("--budget", type=int, default=budget, help=budget_help)
    g.add_argument("--period", type=int, default=32, help="rift-dyn: generated tokens between refreshes")
    g.add_argument("--draft-length", type=int, default=11, help="draft tokens per round (k)")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    g.add_argument("--compile", action="store_true", help=compile_help)
    g.add_argument("--output", default=None, help="also write the JSON here")


def prepare_run(args) -> dict:
    """Before any model loads: check the runtime options and ``--output``'s folder (``rift_ada.cli``), and return the
    draft caches the benchmarks compare, full, rift-stat and rift-dyn at ``--budget`` (``rift_ada.policies``).
    Raises ValueError with a one-line message."""
    from ..cli import apply_runtime, check_output
    from ..policies import make_policy

    apply_runtime(args)
    check_output(args.output)
    return {name: make_policy(name, args.budget, period=args.period if name == "rift-dyn" else None)
            for name in ("full", "rift-stat", "rift-dyn")}


def timed(fn, device=None):
    """``(fn(), seconds)``, CUDA's queued work finished at both ends (else the clock would time kernel launches).
    ``device``: synchronise when it is a CUDA device; None: whenever CUDA is available."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far: the difference around a run is what the run compiled."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def warm_up(fn, device=None) -> tuple[float, int]:
    """Run ``fn`` once so that what it compiles is compiled before anything is timed: (its seconds, the graphs it
    compiled)."""
    before = compiled_graphs()
    _, seconds = timed(fn, device)
    return seconds, compiled_graphs() - before


def draft_ms_per_step(results: list) -> float:
    """Milliseconds per draft token over the rounds of ``results`` (``DecodeResult``s)."""
    rounds = [r for x in results for r in x.rounds]
    return 1000 * sum(r.draft_seconds for r in rounds) / max(sum(r.draft_length for r in rounds), 1)


def verify_ms_per_round(results: list) -> float:
    """Milliseconds per target verify over the rounds of ``results`` (``DecodeResult``s)."""
    rounds = [r for x in results for r in x.rounds]
    return 1000 * sum(r.verify_seconds for r in rounds) / max(len(rounds), 1)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (the first difference's index)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def time_hf_assisted(target, draft, prompts: list, max_new_tokens: int, k: int, eos: int | None = None,
                     device=None) -> dict:
    """HF assisted generation with rift-ada's setting (``k`` draft tokens a round, no confidence stop) and with its
    defaults (20 draft tokens, drafting stops when the draft's top probability < 0.4), each over every prompt:
    ``{"hf_assisted": (tokens per prompt, seconds), "hf_assisted_default": ...}``."""
    from ..models import assisted_reference

    return {name: timed(lambda k=k: [assisted_reference(target, draft, ids, max_new_tokens, k, eos) for ids in prompts],
                        device)
            for name, k in (("hf_assisted", k), ("hf_assisted_default", None))}


@torch.inference_mode()
def target_prefill(target, ids: list[int]) -> tuple:
    """(transformers' dynamic cache holding ``ids``, the target's logits at the last one): what ``plain_decode``
    starts from; give it as ``prefilled`` to decode the same prompt again without prefilling it again."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    logits = target(torch.tensor([ids], device=target.device), cache=cache, logits_to_keep=1).logits[0, -1]
    return cache, logits


@torch.inference_mode()
def plain_decode(target, ids: list[int], new_tokens: int, eos: int | None, temperature: float = 0.0,
                 seed: int = 0, step=None, prefilled: tuple | None = None) -> tuple[list[int], float]:
    """The target alone, one token per forward on ``rift_ada.static``'s static cache: the speculate-never baseline
    without transformers' per-step cache concatenation; greedy at temperature 0, else sampled (the decoder's
    ``sampling_probs``, seeded). ``step``: the ``StaticVerify`` (block 1) to run, e.g. a compiled one reused across
    calls (default: a new eager one); compiled and greedy, the tokens stay on the device and are read once at the end
    (``StaticVerify.greedy``). ``prefilled``: ``target_prefill(target, ids)``, copied (default: prefilled here).
    (tokens, decode seconds after the first token)."""
    from ..rounds import cut_at_eos, sample, sampling_probs
    from ..static import StaticVerify

    g = torch.Generator(device=target.device).manual_seed(seed)
    cache, logits = copy.deepcopy(prefilled) if prefilled is not None else target_prefill(target, ids)
    token = sample(sampling_probs(logits, temperature), logits, g)
    step = step or StaticVerify(target, 1)
    cache, tokens = step.cache(cache, len(ids) + new_tokens + 1), [token]
    t = time.perf_counter()
    if temperature == 0 and step.compiled and token != eos and new_tokens > 1:
        steps = new_tokens - 1
        tokens += cut_at_eos(step.greedy(cache, token, steps).tolist(), eos)
        seconds = time.perf_counter() - t  # the read waited for the device
        return tokens, seconds * (len(tokens) - 1) / steps  # steps past an EOS, which the loop cannot see, not counted
    while len(tokens) < new_tokens and token != eos:
        logits = step(cache, [token])[-1]
        token = sample(sampling_probs(logits, temperature), logits, g)
        tokens.append(token)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - t


def generate_tokens(model, ids: list[int], max_new_tokens: int, eos: int | None, **kwargs) -> list[int]:
    """The new tokens of a greedy ``model.generate`` of one prompt; ``kwargs`` go to ``generate`` (a decoding
    method, a cache implementation, ...)."""
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos if eos is not None else 0, **kwargs)
    return out[0, len(ids):].tolist()


def compiled_greedy(target, eos: int | None):
    """Plain greedy ``generate`` on HF's static cache with ``torch.compile``, as ``greedy(ids, max_new_tokens)``."""
    from transformers import CompileConfig

    config = CompileConfig(mode="reduce-overhead" if target.device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return lambda ids, n: generate_tokens(target, ids, n, eos, top_p=None, top_k=None, temperature=None,
                                          cache_implementation="static", compile_config=config)


def bare_forward_ms(model, prompt: list[int], q: int, reps: int = 10) -> float:
    """Median time of a ``q``-token forward after the prompt on transformers' own DynamicCache (cropped back each
    time): what a draft step (q = 1) or a verify (q = k + 1) costs without a decoding loop around it."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([prompt], device=model.device)
        model(ids, cache=cache, logits_to_keep=1)
        n = len(prompt)
        pos = torch.arange(n, n + q, device=model.device)[None]
        times = []
        for _ in range(reps):
            times.append(timed(lambda: model(ids[:, -q:], cache=cache, position_ids=pos, logits_to_keep=q),
                               model.device)[1])
            cache.crop(-q)
    return 1000 * sorted(times)[len(times) // 2]


def generate_path(pair, prompts: list, args, dyn_decoder) -> dict:
    """rift-dyn through ``target.generate(custom_generate=rift_generate)`` and through our loop (``dyn_decoder`` in
    ``decode``, no profiling hooks), alternating per prompt so both see the same machine, each prompt's time the
    fastest of ``--repeats`` runs (another job's bursts only ever slow a run down): {label: (tokens, seconds)}."""
    from ..evaluate import decode
    from ..hf import rift_generate

    eos, dyn = pair.tokenizer.eos_token_id, args.policies["rift-dyn"]

    def loop(ids):
        return decode(dyn_decoder, ids, args.max_new_tokens, dyn.controller).tokens

    def generate(ids):
        return generate_tokens(pair.target, ids, args.max_new_tokens, eos, assistant_model=pair.draft,
                               custom_generate=rift_generate, rift_policy="rift-dyn", rift_budget=args.budget,
                               rift_period=args.period, rift_draft_length=args.draft_length)

    out = {}
    for ids in prompts:
        best = {}
        for _ in range(args.repeats):
            for label, fn in (("rift_ada_dyn_loop", loop), ("rift_ada_dyn_generate", generate)):
                tokens, t = timed(lambda: fn(ids))
                best[label] = (tokens, min(t, best.get(label, (None, float("inf")))[1]))
        for label, (tokens, t) in best.items():
            toks, total = out.get(label, ([], 0.0))
            out[label] = toks + [tokens], total + t
    return out
