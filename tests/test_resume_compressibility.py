"""Compressibility training resumes: an interrupted target-output build continues after its last finished prompt,
and a run killed (SIGKILL) after a checkpoint reruns to the same adapter (bit for bit), the same table and the same
W&B run. Real models, peft and wandb offline."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import random_model
from rift_ada.trainers import compressibility as C

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "train_compressibility.py"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true")
SMALL = ["--target", "testbed-lm", "--drafter", "testbed-lm", "--train-prompts", "2", "--steps", "4", "--grad-accum", "1", "--input-tokens", "1024",
         "--continuation-tokens", "16", "--eval-prompts", "1", "--eval-new-tokens", "16", "--eval-budgets", "0.25",
         "--temperatures", "0", "--checkpoint-every", "1"]


class Interrupting(list):
    """Prompts whose second one raises: a build interrupted after its first prompt."""

    def __getitem__(self, i):
        if i == 1:
            raise KeyboardInterrupt
        return super().__getitem__(i)


def test_interrupted_target_build_continues_after_its_last_prompt(tmp_path):
    target = random_model("llama", seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (40,), generator=g).tolist() for _ in range(3)]
    kw = dict(top_k=8, temperature=1.0, seed=5, progress=False)  # sampled: each prompt's seed must not shift
    C.build_target_outputs(target, prompts, 12, tmp_path / "straight", **kw)
    with pytest.raises(KeyboardInterrupt):
        C.build_target_outputs(target, Interrupting(prompts), 12, tmp_path / "resumed", **kw)
    assert not (tmp_path / "resumed" / "meta.json").exists(), "an unfinished build is not a target folder"
    assert len(torch.load(tmp_path / "resumed" / "samples.partial.pt")["samples"]) == 1
    C.build_target_outputs(target, prompts, 12, tmp_path / "resumed", **kw)
    assert not (tmp_path / "resumed" / "samples.partial.pt").exists()
    (_, a), (_, b) = (C.load_target_outputs(tmp_path / d) for d in ("straight", "resumed"))
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def script(out, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), *SMALL, "--output-dir", str(out), *extra], env=ENV,
                          capture_output=True, text=True, timeout=900)


def adapter(out):
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several runs, each with its own timeout
def test_killed_run_reruns_to_the_same_adapter_table_and_wandb_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert script(straight).returncode == 0

    proc = subprocess.Popen([sys.executable, str(SCRIPT), *SMALL, "--output-dir", str(killed)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    try:
        while not (killed / "checkpoints" / "step-1" / "state.pt").exists():
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before its first checkpoint"
            assert time.monotonic() < deadline, "no first checkpoint within 600 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    run_id = json.loads((killed / "state" / "wandb.json").read_text())["id"]
    res = script(killed)
    assert res.returncode == 0, res.stderr[-3000:]

    a, b = adapter(straight), adapter(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "bit-identical adapters"
    rows = [json.loads((d / "results.json").read_text())["rows"] for d in (straight, killed)]
    assert rows[0] == rows[1]
    assert [p.name.rsplit("-", 1)[1] for p in sorted((killed / "wandb").glob("offline-run-*"))] == [run_id, run_id]

    other = script(killed, "--lr", "1e-3")  # other training settings never continue this run's checkpoints
    assert other.returncode == 2 and "--lr 0.0005 -> 0.001" in other.stderr and "--no-resume" in other.stderr
