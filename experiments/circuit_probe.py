"""Measure the experimental copying circuit (rift_ada/testbed/circuit.py) beside a trained testbed model.

    python experiments/circuit_probe.py                       # stage-8 target of the v2 build, defaults
    python experiments/circuit_probe.py --boost 8 --self-weight 0.3 --save /tmp/composite

Prints one JSON object: greedy copy accuracy (and each prompt's first wrong token) on held-out ``low`` prompts and
teacher-forced top-1 / NLL on held-out plain code, for the trained model alone and with the circuit beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm", default="build/testbed/stage-8/target", help="a trained Llama folder (tied embeddings)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--input-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--code-windows", type=int, default=8)
    p.add_argument("--boost", type=float, default=None, help="CopyCircuit.boost (default: the dataclass's)")
    p.add_argument("--self-weight", type=float, default=None, help="CopyCircuit.self_weight")
    p.add_argument("--match-dim", type=int, default=None, help="CopyCircuit.match_dim")
    p.add_argument("--save", default=None, help="write the composed model (and tokenizer) to this folder")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import LlamaForCausalLM

    from rift_ada.data.corpus import load_corpus
    from rift_ada.data.tasks import build_tasks, encode
    from rift_ada.models import greedy_reference, load_tokenizer
    from rift_ada.testbed.check import code_scores, code_windows, copy_accuracy
    from rift_ada.testbed.circuit import CopyCircuit, compose

    try:
        lm = LlamaForCausalLM.from_pretrained(args.lm).eval()
    except OSError as e:
        print(f"error: cannot load --lm {args.lm!r}: {e}", file=sys.stderr)
        return 2
    tok = load_tokenizer("testbed")
    overrides = {k: v for k, v in (("boost", args.boost), ("self_weight", args.self_weight),
                                   ("match_dim", args.match_dim)) if v is not None}
    circuit = CopyCircuit(**overrides)
    calibration = code_windows(tok, load_corpus(split="train"), 4, 1024, seed=1)
    try:
        composite = compose(lm, circuit, calibration)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.save:
        composite.save_pretrained(args.save)
        tok.save_pretrained(args.save)
    tasks = build_tasks(tok, "low", n=args.prompts, input_tokens=args.input_tokens, seed=0)
    windows = code_windows(tok, load_corpus(split="eval"), args.code_windows, 1024)
    result = {"lm": args.lm, "circuit": asdict(circuit), "input_tokens": args.input_tokens,
              "new_tokens": args.new_tokens}
    for name, model in (("alone", lm), ("with_circuit", composite)):
        accs, firsts = [], []
        for t in tasks:
            prompt, ref = encode(tok, t.prompt), encode(tok, t.reference)
            out = greedy_reference(model, prompt, args.new_tokens)
            accs.append(copy_accuracy(out, ref, args.new_tokens))
            firsts.append(next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), args.new_tokens))
        code = code_scores(model, windows)
        result[name] = {"copy_accuracy": round(sum(accs) / len(accs), 4), "first_error": firsts,
                        "code_top1": round(code["top1"], 4), "code_nll": round(code["nll"], 4),
                        "parameters": sum(q.numel() for q in model.parameters())}
        print(name, result[name], file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
