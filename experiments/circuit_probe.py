"""Measure the testbed's copier (testbed/circuit.py) beside the trained models, alone and composed, with
its settings varied: the tool for changing the copier before a build stores new settings.

    python experiments/circuit_probe.py                          # the shipped trained models and settings (~5 min)
    python experiments/circuit_probe.py --boost 10 --gate 0.5 0.8 --source-dir DIR
    python experiments/circuit_probe.py --build build/testbed/stage-8 --save build/composite   # then in full:
    python -m rift_ada.testbed check --target build/composite/target --draft build/composite/draft --json

Prints one JSON object: for the target and the draft, alone and with the circuit beside them, greedy copy accuracy
(and each prompt's first wrong token) on held-out ``low`` prompts and teacher-forced top-1 / NLL on held-out plain
code. The settings start from the shipped ones (rift_ada.testbed.composed.CIRCUITS, calibration from circuit.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=None,
                   help="a folder with trained 'target' and 'draft' Llamas (tied embeddings; default: the shipped "
                        "trained models, testbed/assets/lm-*)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--input-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--code-windows", type=int, default=8)
    p.add_argument("--source-dir", default=None, help="build the prompts and code windows from this code base")
    p.add_argument("--boost", type=float, default=None, help="CopyCircuit.boost (default: the dataclass's)")
    p.add_argument("--gate", type=float, nargs=2, default=None, metavar=("LO", "HI"), help="CopyCircuit.gate")
    p.add_argument("--save", default=None, help="write the composed target and draft (and tokenizer) under this "
                                                "folder, as DIR/target and DIR/draft")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import LlamaForCausalLM

    from rift_ada.data.corpus import load_corpus
    from rift_ada.data.tasks import build_tasks, encode
    from rift_ada.models import greedy_reference, load_tokenizer
    from rift_ada.testbed.check import code_scores, code_windows, copy_accuracy
    from rift_ada.testbed.circuit import compose, sort_labels
    from rift_ada.testbed.composed import CIRCUITS, lm_folder, read_settings

    tok = load_tokenizer("testbed-lm")
    overrides = {k: v for k, v in (("boost", args.boost), ("gate", tuple(args.gate) if args.gate else None))
                 if v is not None}
    folders = {role: Path(args.build) / role if args.build else lm_folder(role) for role in ("target", "draft")}
    missing = [role for role, folder in folders.items() if not (folder / "config.json").is_file()]
    if missing:
        print(f"error: --build {args.build!r} has no trained {' or '.join(missing)} folder (expected "
              f"{args.build}/target and {args.build}/draft, as experiments/build_testbed.py writes them)",
              file=sys.stderr)
        return 2
    try:
        lms = {role: LlamaForCausalLM.from_pretrained(folder).eval() for role, folder in folders.items()}
        circuits = {role: replace(CIRCUITS[role], **overrides) for role in lms}
        calibration = read_settings()["calibration"]
        labels = sort_labels(tok)
        composites = {role: compose(lms[role], circuits[role], calibration, labels=labels) for role in lms}
        tasks = build_tasks(tok, "low", n=args.prompts, input_tokens=args.input_tokens, seed=0,
                            source_dir=args.source_dir)
        files = load_corpus(args.source_dir, "all") if args.source_dir else load_corpus(split="eval")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.save:
        for role, model in composites.items():
            model.save_pretrained(Path(args.save) / role)
            tok.save_pretrained(Path(args.save) / role)
    windows = code_windows(tok, files, args.code_windows, 1024)
    result = {"build": args.build, "input_tokens": args.input_tokens, "new_tokens": args.new_tokens,
              "source_dir": args.source_dir}
    for role in ("target", "draft"):
        result[role] = {"circuit": asdict(circuits[role])}
        for name, model in (("alone", lms[role]), ("with_circuit", composites[role])):
            accs, firsts = [], []
            for t in tasks:
                prompt, ref = encode(tok, t.prompt), encode(tok, t.reference)
                out = greedy_reference(model, prompt, args.new_tokens)
                accs.append(copy_accuracy(out, ref, args.new_tokens))
                firsts.append(next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), args.new_tokens))
            code = code_scores(model, windows)
            row = {"copy_accuracy": round(sum(accs) / len(accs), 4), "first_error": firsts,
                   "code_top1": round(code["top1"], 4), "code_nll": round(code["nll"], 4),
                   "parameters": sum(q.numel() for q in model.parameters())}
            result[role][name] = row
            print(role, name, row, file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
