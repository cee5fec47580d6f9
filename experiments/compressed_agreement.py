"""How much of the target's continuation a model can predict from a RIFT-compressed cache: a decode-free proxy of AL.

    python experiments/compressed_agreement.py --source-dir DIR --models testbed-draft testbed-target
    python experiments/compressed_agreement.py --source-dir DIR --models testbed-draft --lora runs/compressibility/adapter

On held-out prompts the target's greedy continuation and top-k log-probabilities are stored once (--targets-dir,
the compressibility trainer's format). Each model then reads prompt + continuation under the masks of a RIFT-stat
cache at each --budgets (its own dense pass selects at the prompt end, as rift-stat does, and with --period N again
every N continuation tokens, as rift-dyn does; the masks are the trainer's, tested against the cache's own logits)
and is scored against the target's distribution per position: ``accept`` = mean sum(min(p, q)) (the chance a token
drafted at temperature 1 is kept) and ``top1`` (the draft's argmax is the target's: temperature 0), overall and on
the continuation's second half, where a prefill-time selection has gone stale. Any causal LM sharing the tokenizer
can be scored, the target included: the target on its own compressed cache shows what a larger model predicts from
the same number of kept tokens, which is what separates "the draft has not learned to use its compressed cache" from
"the kept tokens do not hold the answer".
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from rift_ada.cli import (ArgumentParser, add_runtime_options, add_task_options, apply_runtime, check_output, fail,
                          require_positive, tasks_from_args, write_output)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="testbed", help="the model whose continuation is predicted")
    p.add_argument("--models", nargs="+", default=["testbed-draft", "testbed-target"],
                   help="models to score: testbed names, local folders or hub ids (default: %(default)s)")
    p.add_argument("--lora", default=None, help="a LoRA adapter: the first of --models is also scored with it")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25],
                   help="RIFT-stat budgets as fractions of the prompt (default: %(default)s)")
    p.add_argument("--period", type=int, default=None,
                   help="also score RIFT-dyn at each budget, re-selecting every this many continuation tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="continuation tokens scored per prompt")
    p.add_argument("--targets-dir", default=None, help="where the target outputs are kept (default: not kept)")
    p.add_argument("--output", default=None, help="write the numbers here (JSON)")
    add_task_options(p, prompts=4, input_tokens=2048, task="low")
    add_runtime_options(p)
    args = p.parse_args(argv)
    require_positive(p, args, ("new_tokens", "prompts", "threads"))
    if args.period is not None and args.period < 1:
        p.error("--period must be >= 1")
    if any(not 0 < b <= 1 for b in args.budgets):
        p.error("--budgets are fractions of the prompt in (0, 1]")
    return args


def score(model, samples: list[dict], budget: float | None, period: int | None = None) -> dict:
    """Mean acceptance probability and top-1 agreement of ``model`` under RIFT-stat masks (budget None: dense), or
    RIFT-dyn's re-selected every ``period`` tokens."""
    from rift_ada.trainers import compressibility as C

    accept, top1, late_accept, late_top1 = [], [], [], []
    for s in samples:
        ids = torch.cat([s["prompt_ids"], s["continuation_ids"]])[None].to(model.device)
        p = len(s["prompt_ids"])
        masks = None
        if budget is not None:
            masks = C.compressed_masks(model, ids, p, C.sample_layout(p, (budget,), random.Random(0)), period)
        with torch.no_grad():
            logits = C.continuation_logits(model, ids, masks, p).cpu()
        a, t = C.position_acceptance(logits, s["topk_ids"], s["topk_logprobs"])
        half = len(a) // 2
        accept.append(a.mean())
        top1.append(t.mean())
        late_accept.append(a[half:].mean())
        late_top1.append(t[half:].mean())
    mean = lambda xs: float(torch.stack(xs).mean())  # noqa: E731
    return {"accept": mean(accept), "top1": mean(top1), "accept_second_half": mean(late_accept),
            "top1_second_half": mean(late_top1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        apply_runtime(args)
        check_output(args.output)
        return _main(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)


def _main(args) -> int:
    from rift_ada import lora
    from rift_ada.attention import use_rift_attention
    from rift_ada.data import encode_prompts
    from rift_ada.models import check_vocab, load_model, load_tokenizer, resolve
    from rift_ada.trainers import compressibility as C

    tokenizer = load_tokenizer(resolve(args.target))
    target = load_model(resolve(args.target), dtype=args.dtype, device=args.device)
    prompts = encode_prompts(tokenizer, tasks_from_args(args, tokenizer))
    samples = C.prompt_outputs(target, prompts, args.new_tokens, args.target, args.targets_dir)
    rows = []
    for i, name in enumerate(args.models):
        model = target if resolve(name) == resolve(args.target) else load_model(resolve(name), dtype=args.dtype,
                                                                                device=args.device)
        check_vocab(target, model)
        versions = [(name, model)]
        if i == 0 and args.lora:
            versions.append((f"{name} + {args.lora}", lora.load_drafter(model, args.lora, merge=True)))
        for label, m in versions:
            use_rift_attention(m)
            settings = [(None, None)] + [(b, None) for b in args.budgets] + \
                [(b, args.period) for b in args.budgets if args.period]
            for budget, period in settings:
                row = {"model": label, "budget_fraction": budget, "period": period,
                       **score(m, samples, budget, period)}
                rows.append(row)
                where = "full cache" if budget is None else \
                    f"rift-{'dyn' if period else 'stat'} {100 * budget:g}%"
                print(f"{label:40s} {where:16s} accept {row['accept']:.4f} top1 {row['top1']:.4f} | second half: "
                      f"accept {row['accept_second_half']:.4f} top1 {row['top1_second_half']:.4f}", flush=True)
    write_output(args.output, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
