"""Build the built-in testbed: tokenizer, target and draft, trained from scratch on the standard library.

    python experiments/build_testbed.py            # the shipped recipe (see README for its time on 2 cores)
    python experiments/build_testbed.py --quick    # a provisional pair in a few minutes (smoke tests, new recipes)

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
from rift_ada.testbed.train import ModelShape, Stage, TokenCorpus, train_model

VOCAB = 1024
SHAPES = {
    "target": ModelShape(layers=2, hidden=192, intermediate=384, heads=4, kv_heads=2),
    "draft": ModelShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2),
}


def recipe(quick: bool) -> list[Stage]:
    """Induction warm-up on dense random repeats, then longer contexts mixed with copy tasks and plain code."""
    if quick:
        return [
            Stage(steps=300, length=128, batch=64, lr=1e-3, warmup=100, mix={"repeat": 1.0}),
            Stage(steps=60, length=512, batch=8, lr=5e-4, warmup=10, mix={"copy": 0.5, "code": 0.5}),
        ]
    return [
        Stage(steps=1000, length=128, batch=64, lr=1e-3, warmup=200, mix={"repeat": 1.0}),
        Stage(steps=400, length=512, batch=16, lr=5e-4, warmup=50, mix={"repeat": 0.4, "copy": 0.4, "code": 0.2}),
        Stage(steps=400, length=2048, batch=4, lr=3e-4, warmup=50, mix={"repeat": 0.2, "copy": 0.5, "code": 0.3}),
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
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{role}: {n_params / 1e6:.2f}M parameters", file=sys.stderr)
        history = train_model(model, stages, corpus, seed=args.seed, desc=role, log=None)
        folder = out / role
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        log["models"][role] = {"parameters": n_params, "shape": SHAPES[role].__dict__, "seconds": round(time.time() - t0),
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
