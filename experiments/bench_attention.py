"""The target's static verify forward, by verify width and context length, with the grouped query heads folded into
the KV heads' rows (rift_ada.static.grouped_attention) against SDPA's own ``enable_gqa``: what a plain step (width
1) and a verify of k drafts (width k + 1) cost, the medians of ``--repeats`` calls.

    python experiments/bench_attention.py --lengths 1024 4096 7168 --widths 1 2 3 4 8 12
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rift_ada import static
from rift_ada.models import load_pair
from rift_ada.static import StaticKV, StaticVerify


def sdpa_gqa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 7168])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 8, 12])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    if min(args.lengths) < 1 or min(args.widths) < 1 or args.repeats < 1:
        ap.error("--lengths, --widths and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    target = load_pair(args.target, args.target).target
    verify, rows = StaticVerify(target, max(args.widths)), []
    for length in args.lengths:
        with torch.inference_mode():
            cache = DynamicCache(config=target.config)
            target(torch.randint(0, target.config.vocab_size, (1, length)), past_key_values=cache)
        kv = StaticKV(cache, length + max(args.widths))
        for width in args.widths:
            row = {"length": length, "width": width}
            for name, attend in (("folded_ms", static.grouped_attention), ("enable_gqa_ms", sdpa_gqa)):
                with mock.patch.object(static, "grouped_attention", attend):
                    times = []
                    for _ in range(args.repeats + 1):  # the first call warms up
                        t = time.perf_counter()
                        verify(kv, [1] * width)
                        times.append(time.perf_counter() - t)
                        kv.length -= width
                row[name] = round(1000 * sorted(times[1:])[args.repeats // 2], 2)
            rows.append(row)
            print(f"{length:>6} tokens, width {width:>2}: folded {row['folded_ms']:7.2f} ms, "
                  f"enable_gqa {row['enable_gqa_ms']:7.2f} ms", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"target": args.target, "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
