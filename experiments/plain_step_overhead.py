"""What a plain target step costs inside the speculative decoder, against plain decoding on the same static cache.

    python experiments/plain_step_overhead.py --input-tokens 4096 --new-tokens 128 --repeats 3

A joint controller that stops speculating (k = 0 every round) should run at plain decoding's speed; whatever the
decoder's loop adds around the target's forward (sampling through the acceptance rule, the round's record, the
published state and its signals) is what it loses. One prompt, both loops alternated in this process; each verify
forward is timed apart, so the loop's own cost per token is read without the forward's run-to-run spread. With
``--controller FILE`` the controller's ``act`` on the decoder's state is timed too (it runs before every round).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rift_ada.studies.decode_bench import plain_decode
from rift_ada.cli import ArgumentParser, add_model_options, add_runtime_options, apply_runtime, fail, require_positive
from rift_ada.data.sources import source_folder
from rift_ada.data.tasks import build_tasks, encode
from rift_ada.layout import CacheLayout
from rift_ada.models import load_pair
from rift_ada.speculative import Decoding, SpeculativeDecoder
from rift_ada.static import StaticVerify


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed")
    add_runtime_options(p)
    p.add_argument("--input-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--task", default="high")
    p.add_argument("--source-dir", default="pip")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--controller", default=None, help="a controller file whose act() is timed on the decoder's state")
    args = p.parse_args(argv)
    require_positive(p, args, ("input_tokens", "new_tokens", "repeats", "budget"))
    if args.new_tokens < 2:  # the first token comes with the prefill: per-token figures need a second one
        p.error(f"--new-tokens must be >= 2, got {args.new_tokens}")
    return args


class ForwardClock:
    """Seconds spent inside ``StaticVerify.__call__`` and ``StaticVerify.on_device`` (the target's forward, inputs
    included; the decoder's device rounds verify through the latter) while installed."""

    METHODS = ("__call__", "on_device")

    def __init__(self):
        self.seconds, self._orig = 0.0, {name: getattr(StaticVerify, name) for name in self.METHODS}

    def __enter__(self):
        clock = self

        def timing(orig):
            def timed(verify, *args):
                t = time.perf_counter()
                out = orig(verify, *args)
                clock.seconds += time.perf_counter() - t
                return out
            return timed

        for name, orig in self._orig.items():
            setattr(StaticVerify, name, timing(orig))
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(StaticVerify, name, orig)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        apply_runtime(args)
        pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype)
        task = build_tasks(pair.tokenizer, args.task, n=1, input_tokens=args.input_tokens, seed=args.seed,
                           source_dir=source_folder(args.source_dir))[0]
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    ids, eos = encode(pair.tokenizer, task.prompt), pair.tokenizer.eos_token_id
    decoding = Decoding(11, args.temperature, seed=args.seed, draft_step="static", verify_step="static")

    def decoder_run():
        dec = SpeculativeDecoder.for_pair(pair, CacheLayout("rift", budget=args.budget), decoding)
        dec.reset(ids, args.new_tokens)
        t = time.perf_counter()
        for _ in dec.rounds(lambda state: (False, 0)):
            pass
        return time.perf_counter() - t, len(dec.result.tokens) - 1, dec

    rows = []
    for rep in range(args.repeats):
        for name in ("plain", "decoder") if rep % 2 == 0 else ("decoder", "plain"):
            with ForwardClock() as clock:
                if name == "plain":
                    toks, secs = plain_decode(pair.target, ids, args.new_tokens, eos, args.temperature, args.seed)
                    n = len(toks) - 1
                else:
                    secs, n, dec = decoder_run()
            rows.append({"loop": name, "ms_per_token": 1000 * secs / n, "forward_ms": 1000 * clock.seconds / n,
                         "loop_ms": 1000 * (secs - clock.seconds) / n})
    out = {"input_tokens": len(ids), "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "rows": rows}
    for name in ("plain", "decoder"):
        mine = [r["loop_ms"] for r in rows if r["loop"] == name]
        out[f"{name}_loop_ms"] = sum(mine) / len(mine)
    if args.controller:
        from rift_ada.refresh.loader import load_controller

        controller, reps = load_controller(args.controller), 2000
        t = time.perf_counter()
        for _ in range(reps):
            controller(dec.state)
        out["act_ms"] = 1000 * (time.perf_counter() - t) / reps
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
