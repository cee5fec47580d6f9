"""Build the built-in testbed: tokenizer, target and draft, trained on the standard library.

    python experiments/build_testbed.py            # the shipped recipe (see README for its time on 2 cores)
    python experiments/build_testbed.py --quick    # the same circuits, a few training steps (smoke tests)

Both models start from a hand-set copying circuit (``CircuitInit``, disclosed in the README and the training log:
it stands in for what pretrained LMs learn from trillions of tokens) and are then trained, all weights, on the
copy-task format and plain code from the training split.

Writes HuggingFace folders (config.json, model.safetensors, tokenizer files) to rift_ada/testbed/assets/{target,draft}
(or --output-dir) and a training log, then runs the testbed check on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from rift_ada.data.corpus import load_corpus
from rift_ada.models import TESTBED_DIR
from rift_ada.testbed.tokenizer import train_tokenizer
from rift_ada.testbed.train import CircuitInit, ModelShape, Stage, TokenCorpus, init_copy_circuit, train_model

VOCAB = 1024
# Three layers each: two of positional heads (x_{t-1..t-3} and averages over offsets 3-12, 12-40, 40-100), one
# matching head. Copying code greedily needs that much context: 3-grams alone, or one short window, lock onto the
# wrong one of a file's repeated lines (measured: greedy copy 0.2-0.3 with one window, ~0.9-1.0 with three).
# head_dim 128 with a huge rotary base leaves 98 distance-free dims per head for matching.
SHAPES = {
    "target": ModelShape(layers=3, hidden=256, intermediate=384, heads=4, kv_heads=2, head_dim=128),
    "draft": ModelShape(layers=3, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=128),
}
WINDOWS = ((3, 12), (12, 40), (40, 100))
CIRCUITS = {  # the draft gets narrower match codes (12 dims per slot instead of 16): noisier matching
    "target": CircuitInit(exact=3, windows=WINDOWS, match_dim=16, out_dim=96),
    "draft": CircuitInit(exact=3, windows=WINDOWS, match_dim=12, out_dim=48),
}


def recipe(quick: bool) -> list[Stage]:
    """Training from the circuit: the copy-task format (with corrupted inputs inside the copy, so the model learns
    to resynchronise after an error) and plain code, at the prompt lengths the tasks use. A very small learning
    rate: 3e-5 for these steps already eroded greedy copying (target 0.91 -> 0.83 on the 2K check)."""
    if quick:
        return [Stage(steps=10, length=512, batch=4, lr=3e-6, warmup=2, mix={"copy": 0.6, "code": 0.4})]
    return [
        Stage(steps=40, length=1024, batch=4, lr=3e-6, warmup=10, mix={"copy": 0.6, "code": 0.4}),
        Stage(steps=20, length=2048, batch=2, lr=2e-6, warmup=5, mix={"copy": 0.6, "code": 0.4}),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=str(TESTBED_DIR), help="where the target/ and draft/ folders go")
    p.add_argument("--quick", action="store_true", help="a provisional pair in a few minutes")
    p.add_argument("--only", choices=["target", "draft"], default=None, help="train just one of the two models")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-check", action="store_true", help="skip the testbed check at the end")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    from transformers import LlamaForCausalLM

    train_files = load_corpus(split="train")
    tokenizer = train_tokenizer((f.text for f in train_files), VOCAB)
    corpus = TokenCorpus(tokenizer, train_files)
    stages = recipe(args.quick)
    log = {"recipe": [s.__dict__ for s in stages], "quick": args.quick, "seed": args.seed, "models": {}}
    for role in ["target", "draft"] if args.only is None else [args.only]:
        t0 = time.time()
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(SHAPES[role].config(len(tokenizer), tokenizer.eos_token_id))
        circuit = init_copy_circuit(model, CIRCUITS[role], seed=args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{role}: {n_params / 1e6:.2f}M parameters", file=sys.stderr)
        history = train_model(model, stages, corpus, seed=args.seed, desc=role, log=None)
        folder = out / role
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        log["models"][role] = {"parameters": n_params, "shape": SHAPES[role].__dict__,
                               "initialisation": {"hand_set_copy_circuit": circuit}, "seconds": round(time.time() - t0),
                               "history": history}
    log["seconds"] = round(time.time() - t_start)
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    print(f"trained in {log['seconds']} s -> {out}", file=sys.stderr)
    if not args.no_check and args.only is None:
        from rift_ada.testbed.__main__ import main as check

        check(["check", "--target", str(out / "target"), "--draft", str(out / "draft")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
