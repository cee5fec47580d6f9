"""What a refresh decision costs next to the round it decides for.

    python experiments/decision_cost.py --controller runs/controller/controller.json

Decodes one prompt with the exported controller deciding each round (as ``python -m rift_ada.evaluate --policy
rift-ada --controller FILE`` does), and reports per round, in medians: the round's own time (draft, verify, refresh,
rollback), the read-ahead signals (``RiftCache.read_ahead``: one small matmul per RIFT layer, paid every round to
publish the decoder's state), building the observation (``rift_ada.signals.observe``) and the controller's
``decide``, the last two in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from rift_ada.cli import (ArgumentParser, add_cache_options, add_decoding_options, add_model_options,
                          add_runtime_options, add_task_options, apply_runtime, check_output, decoding_from_args,
                          fail, policy_from_args, tasks_from_args, write_output)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--controller", required=True, help="an exported controller file")
    add_model_options(p, drafter="testbed")
    add_cache_options(p, policy=None, budget=256)
    add_decoding_options(p, max_new_tokens=512)
    add_task_options(p, prompts=1, input_tokens=1024, task="low")
    p.add_argument("--output", default=None, help="also write the numbers here (JSON)")
    add_runtime_options(p)
    args = p.parse_args(argv)
    try:
        apply_runtime(args)
        check_output(args.output)
        from rift_ada import signals
        from rift_ada.data import encode
        from rift_ada.models import load_pair
        from rift_ada.refresh import load_controller
        from rift_ada.speculative import SpeculativeDecoder

        controller = load_controller(args.controller)
        layout = policy_from_args(args, "rift-ada", controller="never").layout
        pair = load_pair(args.target, args.drafter, device=args.device, dtype=args.dtype)
        ids = encode(pair.tokenizer, tasks_from_args(args, pair.tokenizer)[0].prompt)
        dec = SpeculativeDecoder.for_pair(pair, layout, decoding_from_args(args))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    dec.reset(ids, args.max_new_tokens)
    observe_us, decide_us, read_ms, round_ms = [], [], [], []
    while not dec.done:
        t0 = time.perf_counter()
        obs = signals.observe(dec.state)
        t1 = time.perf_counter()
        refresh = bool(controller.decide(obs))
        t2 = time.perf_counter()
        rec = dec.step(refresh)
        t3 = time.perf_counter()
        dec.dcache.read_ahead(signals.RUNWAY_CAP)  # what publishing the state after the round paid for it
        read_ms.append(1e3 * (time.perf_counter() - t3))
        observe_us.append(1e6 * (t1 - t0))
        decide_us.append(1e6 * (t2 - t1))
        round_ms.append(1e3 * (rec.draft_seconds + rec.verify_seconds + rec.refresh_seconds + rec.rollback_seconds))
    out = {"controller": str(args.controller), "kind": controller.kind, "rounds": len(round_ms),
           "refreshes": dec.result.refreshes, "round_ms": statistics.median(round_ms),
           "read_ahead_ms": statistics.median(read_ms), "observe_us": statistics.median(observe_us),
           "decide_us": statistics.median(decide_us)}
    out["decision_share_of_round"] = (out["read_ahead_ms"] + 1e-3 * (out["observe_us"] + out["decide_us"])) / \
        out["round_ms"]
    print(f"{controller.kind} controller, {out['rounds']} rounds ({out['refreshes']} refreshes), medians: round "
          f"{out['round_ms']:.1f} ms; read-ahead signals {out['read_ahead_ms']:.2f} ms, observation "
          f"{out['observe_us']:.0f} us, decide {out['decide_us']:.0f} us "
          f"({100 * out['decision_share_of_round']:.2f}% of a round)")
    write_output(args.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
