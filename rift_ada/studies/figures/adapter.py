"""The compressibility-trained draft of figures 2 and 5 when no --adapter is given: the training script
(experiments/train_compressibility.py, whose path the caller gives: scripts are not part of the installed package)
run as a subprocess with this run's settings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def train_adapter(args, folder: Path, script: Path) -> Path:
    """A small compressibility-trained LoRA adapter: ``script`` (train_compressibility.py) in a subprocess (a single
    process whatever torchrun started; its W&B logging off), its stdout in ``folder/train_compressibility.log``."""
    shutil.rmtree(folder, ignore_errors=True)  # always a fresh training with this run's settings
    folder.mkdir(parents=True)
    argv = ["--target", args.target, "--drafter", args.drafter, "--device", args.device, "--threads",
            str(args.threads), "--output-dir", str(folder), "--train-prompts", str(args.train_prompts),
            "--input-tokens", str(args.input_tokens), "--continuation-tokens", str(args.continuation_tokens),
            "--steps", str(args.train_steps), "--checkpoint-every", str(args.train_steps), "--seed", str(args.seed),
            "--draft-length", str(args.draft_length), "--period", str(args.period), "--wandb-mode", "disabled",
            # its own evaluation table is not used here (figures 2 and 5 are): keep it minimal
            "--eval-prompts", "1", "--eval-new-tokens", "8", "--eval-budgets", "0.25", "--temperatures", "0",
            "--eval-every", "0"]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.device_map:
        argv += ["--device-map", args.device_map]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC")}
    with open(folder / "train_compressibility.log", "w") as log:
        code = subprocess.run([sys.executable, str(script), *argv], stdout=log, env=env).returncode
    if code != 0:
        raise RuntimeError(f"compressibility training failed (exit {code}; its error is above, its output in "
                           f"{folder / 'train_compressibility.log'}); or pass --adapter DIR")
    return folder / "adapter"
