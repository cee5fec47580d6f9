"""What experiments/gpu_check.py measures, as functions: real-size shapes built at random (no download), each
compiled step timed beside its bandwidth bound, the round costs that price acceptance tables, and the shipped
testbed pair's compiled decoding. The script (its docstring says what each section holds) parses the options and
runs the sections in order; these are its parts."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


# Shapes from the Qwen3 model cards (config.json of Qwen/Qwen3-8B, Qwen/Qwen3-4B and Qwen/Qwen3-0.6B).
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
# Tiny shapes use a large init: peaked logits leave no near-ties, so greedy outputs can be compared exactly.
TINY_TARGET = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False,
                   initializer_range=0.2)
TINY_DRAFTS = {"4b": dict(TINY_TARGET, hidden_size=96, num_hidden_layers=3, tie_word_embeddings=True),
               "0.6b": dict(TINY_TARGET, hidden_size=64, num_hidden_layers=2, tie_word_embeddings=True)}
DRAFTS = {"4b": QWEN3_4B, "0.6b": QWEN3_06B}
SECTIONS = ("steps", "testbed", "decode", "ties")
REPS = 24  # timed calls per step (after the warm-up that compiles and records the CUDA graph)


def random_model(shape: dict, max_len: int, device: str, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, max_position_embeddings=max_len, rope_theta=1_000_000, rms_norm_eps=1e-6,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def weight_bytes(model) -> int:
    """Bytes a one-token step reads of the weights: all of them, less the input embedding's when it is not also the
    output head (the step reads one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    if emb is not model.get_output_embeddings().weight:
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * model.dtype.itemsize


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def ms_per_call(fn, reps: int, device, between=None) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, the device finished at both ends of each; ``between()``
    runs untimed after each call (a rollback)."""
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(1000 * (time.perf_counter() - t))
        if between is not None:
            between()
    return sorted(times)[len(times) // 2]


class GraphGuard:
    """Fails the run on any CUDA graph inductor skips in our steps: ``cudagraph_or_error`` makes inductor raise
    (where this torch has it), and the skip counter is checked after each section in any case."""

    def __init__(self, device):
        from torch._dynamo.utils import counters
        from torch._inductor import config

        self.counters, self.config, self.cuda = counters, config, torch.device(device).type == "cuda"
        self.strict = self.cuda and hasattr(config.triton, "cudagraph_or_error")
        if self.strict:
            config.triton.cudagraph_or_error = True
        self.allowed = 0  # skips in baselines we only report

    def skips(self) -> int:
        return int(self.counters["inductor"]["cudagraph_skips"])

    def check(self, where: str) -> None:
        if self.skips() > self.allowed:
            raise RuntimeError(f"{where}: inductor skipped {self.skips() - self.allowed} CUDA graph(s) "
                               "(TORCH_LOGS=perf_hints says why)")

    def baseline(self, fn):
        """``fn()`` with skips allowed (HF's compiled generate): (its value, the graphs it skipped)."""
        before = self.skips()
        if self.strict:
            self.config.triton.cudagraph_or_error = False
        try:
            out = fn()
        finally:
            if self.strict:
                self.config.triton.cudagraph_or_error = True
        skipped = self.skips() - before
        self.allowed += skipped
        return out, skipped


# --- steps -------------------------------------------------------------------------------------------------------
class RandomKV:
    """A prefilled cache's layers as random keys and values, made one layer at a time when read (a step's time does
    not depend on what its cache holds, and a 128K prompt's prefill through an 8B model costs tens of seconds)."""

    class Layer:
        def __init__(self, keys, values):
            self.keys, self.values = keys, values

        def get_seq_length(self) -> int:
            return self.keys.shape[-2]

    def __init__(self, model, length: int, device):
        c = model.config
        self.shape = (1, c.num_key_value_heads, length, c.head_dim)
        self.n, self.device, self.dtype = c.num_hidden_layers, device, model.dtype
        self.layers = self

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        gen = torch.Generator(device=self.device).manual_seed(i)
        return self.Layer(*(torch.randn(self.shape, generator=gen, device=self.device, dtype=self.dtype)
                            for _ in range(2)))

    def get_seq_length(self) -> int:
        return self.shape[2]


def prefill_draft(model, ids: torch.Tensor, layout, prefill: str):
    """The draft's cache of ``ids`` under ``layout``: through the model in chunks, or (``random``) random keys,
    values and observation queries in its place, compressed as a prefill's would be."""
    from rift_ada.cache import RiftCache
    from rift_ada.speculative import PREFILL_CHUNK, chunked_forward

    cache = RiftCache.for_config(model.config, layout)
    n = ids.shape[1]
    with torch.inference_mode():
        if prefill == "model":
            chunk = PREFILL_CHUNK if ids.device.type == "cuda" else 0
            chunked_forward(model, ids, torch.arange(n, device=ids.device)[None], chunk, cache=cache,
                            rift_observer=cache)
        else:
            cache.load_from(RandomKV(model, n, ids.device))
            c, w = model.config, min(layout.obs_window, n)
            for layer in cache.rift_layers:
                q = torch.randn(1, c.num_attention_heads, w, c.head_dim, device=ids.device, dtype=model.dtype)
                layer.observe(q, torch.arange(n - w, n, device=ids.device))
        cache.compress()
    return cache


def time_draft(model, step, ids: torch.Tensor, layout, args, weights: int, peak: float) -> dict:
    """The draft's step over a cache of ``ids`` under ``layout``: rounds of k steps from one pending token, each
    round rolled back to one kept token (what a round with no draft accepted leaves), and its refresh."""
    room = ids.shape[1] + 4 * (REPS + 4) + args.draft_length + 2
    t0 = time.perf_counter()
    cache = prefill_draft(model, ids, layout, args.prefill)
    sync(args.device)
    prefill_s = time.perf_counter() - t0
    step.prepare(cache, room)
    k, token = args.draft_length, int(ids[0, -1])

    def one_round():
        step.round(cache, [token], k)

    def roll_back():
        with torch.inference_mode():
            cache.rollback(k - 1)

    warm = ms_per_call(one_round, 3, args.device, roll_back)  # compiles, warms up and records the CUDA graph
    ms = ms_per_call(one_round, REPS, args.device, roll_back) / k
    active = cache.rift_layers[0].n_active
    kv = active * kv_bytes_per_token(model)
    row = {"ms_per_step": ms, "warmup_ms_per_round": warm, "prefill_s": prefill_s, "active_tokens": active,
           "attended_slots": step.arena.capacity, "weight_bytes": weights, "kv_bytes": kv,
           "bound_ms": 1000 * (weights + kv) / peak}
    row["ratio_to_bound"] = ms / row["bound_ms"]
    if layout.refreshable:
        def refresh():
            with torch.inference_mode():
                cache.refresh()
        row["refresh_ms"] = ms_per_call(refresh, 3, args.device)
    row["kernels_per_step"], row["gpu_busy_ms_per_step"] = kernel_profile(one_round, k, roll_back, args.device)
    step.release()  # the cache's buffers: freed with it on return
    return row


def kernel_profile(fn, per_call: int, between, device) -> tuple[float | None, float | None]:
    """Device kernels per step and their summed time (torch.profiler over one call; the kernels a CUDA graph
    replays are listed where the profiler sees into graphs): the floor a small model meets inside a graph."""
    if torch.device(device).type != "cuda":
        return None, None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
        between()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        if not kernels:  # this profiler does not see the kernels a graph replays
            return None, None
        return len(kernels) / per_call, sum(e.device_time for e in kernels) / 1000 / per_call
    except Exception as e:  # the profiler is a nicety here: never the reason a run fails
        print(f"note: no kernel profile ({type(e).__name__}: {e})", file=sys.stderr)
        return None, None


def time_target(target, verify, plain, ids: torch.Tensor, args, peak: float) -> dict:
    """The target's verify of k + 1 tokens and its plain step over a cache of ``ids``, each rolled back after."""
    from transformers import DynamicCache

    from rift_ada.speculative import PREFILL_CHUNK, chunked_forward

    n, k = ids.shape[1], args.draft_length
    t0 = time.perf_counter()
    with torch.inference_mode():
        if args.prefill == "model":
            prefilled = DynamicCache(config=target.config)
            chunk = PREFILL_CHUNK if ids.device.type == "cuda" else 0
            chunked_forward(target, ids, torch.arange(n, device=ids.device)[None], chunk, cache=prefilled)
        else:
            prefilled = RandomKV(target, n, ids.device)
        cache = verify.cache(prefilled, n + k + 2)
    del prefilled
    sync(args.device)
    prefill_s = time.perf_counter() - t0
    drafts = torch.zeros(k, dtype=torch.long, device=ids.device)
    token = int(ids[0, -1])

    def back(m):
        return lambda: cache.crop(-m)

    weights, per_token = weight_bytes(target), kv_bytes_per_token(target)
    row = {"prefill_s": prefill_s, "weight_bytes": weights, "kv_bytes": n * per_token}
    for name, fn, m in (("verify", lambda: verify.on_device(cache, token, drafts), k + 1),
                        ("plain", lambda: plain(cache, [token]), 1)):
        warm = ms_per_call(fn, 3, args.device, back(m))
        ms = ms_per_call(fn, REPS, args.device, back(m))
        bound = 1000 * (weights + n * per_token) / peak
        row[name] = {"ms": ms, "warmup_ms": warm, "bound_ms": bound, "ratio_to_bound": ms / bound}
    verify.release()
    return row


def steps_section(target, drafts: dict, args, report: dict, save) -> None:
    from rift_ada.policies import make_policy
    from rift_ada.static import StaticDraftStep, StaticVerify

    compiled, peak, k = args.steps == "compiled", args.peak_tb_s * 1e12, args.draft_length
    verify, plain = StaticVerify(target, k + 1, compile=compiled), StaticVerify(target, 1, compile=compiled)
    steps = {name: StaticDraftStep(model, compile=compiled) for name, model in drafts.items()}
    layouts = {"rift": make_policy("rift-dyn", args.budget, period=args.period).layout,
               "full": make_policy("full").layout}
    gen = torch.Generator().manual_seed(0)
    report["steps"] = []
    for length in args.lengths:
        ids = torch.randint(0, target.config.vocab_size, (1, length), generator=gen).to(args.device)
        row = {"input_tokens": length}
        parts = [("target", None, lambda: time_target(target, verify, plain, ids, args, peak))]
        for name, model in drafts.items():
            caches = ("rift", "full") if name in args.full else ("rift",)
            parts += [(name, cache, lambda m=model, n=name, c=cache: time_draft(
                m, steps[n], ids, layouts[c], args, weight_bytes(m), peak)) for cache in caches]
        for name, cache, part in parts:
            try:  # a part that fails (out of memory at 128K, a skipped graph) is recorded; the others still run
                value = part()
            except Exception as e:
                value = failed(f"steps {length} {name} {cache or ''}", e, args.device)
            if cache is None:
                row[name] = value
            else:
                row.setdefault(name, {})[cache] = value
        if torch.device(args.device).type == "cuda":
            row["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        report["steps"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        save()
    report["costs"] = round_costs(report, args)


def failed(where: str, e: Exception, device) -> dict:
    """A part that raised, as its row says it (the traceback goes to the log)."""
    import traceback

    traceback.print_exc()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"error": f"{where}: {type(e).__name__}: {str(e)[:1500]}"}


def round_costs(report: dict, args) -> dict:
    """Per draft: the joint controller's ``RoundCosts`` from the measured steps (verify at block 1 = the plain step,
    at 2..k + 1 = the padded verify; draft step and refresh by length) and the full-cache step by length."""
    from rift_ada.joint.costs import RoundCosts

    k = args.draft_length
    out = {}
    for name in args.drafts:
        # The lengths whose target and RIFT step were both measured (a failed part leaves an error instead).
        rows = [r for r in report["steps"] if "error" not in r["target"] and "error" not in r[name]["rift"]]
        if not rows:
            continue
        costs = RoundCosts(
            lengths=tuple(r["input_tokens"] for r in rows), blocks=(1, 2, k + 1),
            verify_s=tuple((r["target"]["plain"]["ms"] / 1000,) + (r["target"]["verify"]["ms"] / 1000,) * 2
                           for r in rows),
            draft_s=tuple(r[name]["rift"]["ms_per_step"] / 1000 for r in rows),
            refresh_s=tuple(r[name]["rift"]["refresh_ms"] / 1000 for r in rows), budget=args.budget,
            steps=args.steps)
        entry = {"rift": costs.to_dict()}
        if all("ms_per_step" in r[name].get("full", {}) for r in rows):
            entry["full_draft_s"] = [r[name]["full"]["ms_per_step"] / 1000 for r in rows]
        out[name] = entry
    return out


# --- the shipped pair --------------------------------------------------------------------------------------------
def testbed_section(args, guard: GraphGuard) -> dict:
    """The shipped pair in float32 on one ``low`` prompt: rift-dyn compiled against compiled greedy, decode only,
    each warmed up on the same prompt first."""
    from rift_ada.studies.decode_bench import compiled_greedy, plain_decode, timed
    from rift_ada.data import build_tasks, encode
    from rift_ada.evaluate import decode
    from rift_ada.models import greedy_reference, load_pair
    from rift_ada.policies import make_policy
    from rift_ada.speculative import Decoding, SpeculativeDecoder
    from rift_ada.static import StaticVerify

    pair = load_pair("testbed", "testbed-draft", device=args.device, dtype="float32")
    eos, n = pair.tokenizer.eos_token_id, args.testbed_new_tokens
    ids = encode(pair.tokenizer, build_tasks(pair.tokenizer, "low", n=1, input_tokens=args.testbed_length)[0].prompt)
    reference = greedy_reference(pair.target, ids, n, eos)
    policy = make_policy("rift-dyn", 512, period=args.period)
    dec = SpeculativeDecoder.for_pair(pair, policy.layout, Decoding(args.draft_length, draft_step=args.steps,
                                                                    verify_step=args.steps))
    out = {"input_tokens": len(ids), "new_tokens": n}
    decode(dec, ids, n, policy.controller)  # warm-up: compiles, records the graphs
    reads = dec.host_reads
    res = decode(dec, ids, n, policy.controller)
    out["rift_dyn"] = {"tokens_per_s": (len(res.tokens) - 1) / res.decode_seconds,
                       "acceptance_length": (len(res.tokens) - 1) / len(res.rounds), "refreshes": res.refreshes,
                       "host_reads_per_round": (dec.host_reads - reads) / len(res.rounds),
                       "same_as_hf_greedy": res.tokens == reference}
    step = StaticVerify(pair.target, 1, compile=args.steps == "compiled")
    plain_decode(pair.target, ids, n, eos, step=step)  # warm-up
    tokens, seconds = plain_decode(pair.target, ids, n, eos, step=step)
    out["greedy_ours"] = {"tokens_per_s": (len(tokens) - 1) / seconds, "same_as_hf_greedy": tokens == reference}
    if args.steps != "compiled":  # HF's compiled generate is the compiled baseline: nothing to set against static
        out["rift_dyn_vs_best_greedy"] = out["rift_dyn"]["tokens_per_s"] / out["greedy_ours"]["tokens_per_s"]
        return out
    greedy = compiled_greedy(pair.target, eos)

    def hf():
        greedy(ids, n)  # warm-up
        toks, t_all = timed(lambda: greedy(ids, n), args.device)
        _, t_one = timed(lambda: greedy(ids, 1), args.device)
        return toks, (len(toks) - 1) / max(t_all - t_one, 1e-9)

    (toks, speed), skipped = guard.baseline(hf)
    out["greedy_hf_compiled"] = {"tokens_per_s": speed, "same_as_hf_greedy": toks == reference,
                                 "cudagraphs_skipped": skipped}
    best = max(out["greedy_ours"]["tokens_per_s"], out["greedy_hf_compiled"]["tokens_per_s"])
    out["rift_dyn_vs_best_greedy"] = out["rift_dyn"]["tokens_per_s"] / best
    return out


def ties_section(args) -> dict:
    """Where bf16 greedy outputs part from HF's at ``--tie-length``: the float32 target's logits at that position,
    the margin between the two tokens chosen (a near-tie when it is within bf16's rounding of logits that size)."""
    from rift_ada.studies.decode_bench import plain_decode, shared_prefix
    from rift_ada.data import build_tasks, encode
    from rift_ada.evaluate import decode
    from rift_ada.models import greedy_reference, load_model, load_pair
    from rift_ada.policies import make_policy
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    dtype = "float32" if torch.device(args.device).type == "cpu" else "bfloat16"
    pair = load_pair("testbed", "testbed-draft", device=args.device, dtype=dtype)
    eos, n = pair.tokenizer.eos_token_id, min(128, args.testbed_new_tokens)
    ids = encode(pair.tokenizer, build_tasks(pair.tokenizer, "low", n=1, input_tokens=args.tie_length)[0].prompt)
    hf = greedy_reference(pair.target, ids, n, eos)
    policy = make_policy("rift-dyn", 512, period=args.period)
    dec = SpeculativeDecoder.for_pair(pair, policy.layout, Decoding(args.draft_length, draft_step="static",
                                                                    verify_step="static"))
    outputs = {"static_greedy": plain_decode(pair.target, ids, n, eos)[0],
               "rift_dyn_static": decode(dec, ids, n, policy.controller).tokens}
    f32 = load_model("testbed", dtype="float32", device=args.device)
    out = {"dtype": dtype, "input_tokens": len(ids)}
    for name, tokens in outputs.items():
        i = shared_prefix(tokens, hf)
        row = {"shared_prefix": i, "equal": tokens == hf}
        if i < min(len(tokens), len(hf)):
            with torch.inference_mode():
                logits = f32(torch.tensor([ids + hf[:i]], device=args.device), logits_to_keep=1).logits[0, -1]
            a, b = hf[i], tokens[i]
            top = logits.topk(2).values
            row.update(hf_token=a, other_token=b, float32_logit_gap=float(logits[a] - logits[b]),
                       float32_top2_gap=float(top[0] - top[1]), logit_scale=float(logits.abs().max()),
                       float32_argmax=int(logits.argmax()))
        out[name] = row
    return out


def decode_section(target, drafts: dict, args) -> dict:
    """One compiled rift-dyn generation with the first draft at the first length, after a warm-up on it."""
    from rift_ada.evaluate import decode
    from rift_ada.policies import make_policy
    from rift_ada.speculative import SpeculativeDecoder

    name, draft = next(iter(drafts.items()))
    length = args.lengths[0]
    ids = torch.randint(0, target.config.vocab_size, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    policy = make_policy("rift-dyn", args.budget, period=args.period)
    dec = SpeculativeDecoder(target, draft, policy.layout, args.draft_length, draft_step=args.steps,
                             verify_step=args.steps)
    decode(dec, ids, args.max_new_tokens, policy.controller)
    reads = dec.host_reads
    res = decode(dec, ids, args.max_new_tokens, policy.controller)
    rounds = res.rounds
    drafted = max(sum(r.draft_length for r in rounds), 1)
    return {"draft": name, "input_tokens": length, "new_tokens": len(res.tokens), "rounds": len(rounds),
            "decode_tokens_per_s": (len(res.tokens) - 1) / res.decode_seconds,
            "prefill_s": res.prefill_seconds, "host_reads_per_round": (dec.host_reads - reads) / len(rounds),
            "round_ms": 1000 * res.decode_seconds / len(rounds),
            "draft_ms_per_step_in_loop": 1000 * sum(r.draft_seconds for r in rounds) / drafted,
            "acceptance_length": (len(res.tokens) - 1) / len(rounds), "refreshes": res.refreshes}


# --- modelled tokens/s ---------------------------------------------------------------------------------------------
def model_section(args) -> dict:
    """Modelled decode tokens/s of ``--tables`` under the costs of ``--model-from``, per draft, at each length."""
    from rift_ada.joint.costs import RoundCosts
    from rift_ada.joint.replay import modelled_paths
    from rift_ada.replay.table import load_folder

    measured = json.loads(Path(args.model_from).read_text())
    if "costs" not in measured:
        raise ValueError(f"{args.model_from}: no costs (a gpu_check JSON whose steps section finished)")
    tables = load_folder(args.tables)  # the main tables: a paper-regime folder also holds SnapKV's, window's, ...
    controller = None
    if args.controller:
        from rift_ada.joint.control import is_joint
        from rift_ada.refresh.loader import load_controller

        controller = load_controller(args.controller)
        if not is_joint(controller):
            raise ValueError(f"--controller {args.controller}: not a joint controller file")
    out = {"tables": len(tables), "table_prompt_tokens": sorted({t.prompt_len for t in tables}), "drafts": {}}
    for name, entry in measured["costs"].items():
        costs = RoundCosts.from_dict(entry["rift"], args.model_from)
        full = entry.get("full_draft_s") or [float("nan")] * len(costs.lengths)
        rows = entry.get("batch", 1)  # costs of rounds that served this many rows (bench_decode.py --batch-sizes)
        out["drafts"][name] = {
            str(length): {path: {"tokens_per_s": rows * r["tokens_per_s"], "acceptance_length": r["acceptance_length"],
                                 "refreshes": r["refreshes"], "k_share": r["k_share"]}
                          for path, r in modelled_paths(tables, costs, full, args.draft_length, args.period,
                                                        controller, price_at=length).items()}
            for length in costs.lengths}
        out["drafts"][name]["costs"] = entry
    return out
