"""Compressibility training, its target-output precompute and replay tables under torchrun (two CPU
processes, gloo) against one process: the same global batch gives the same loss curve (up to the summation order of
the gradients), a resumed run the same as an uninterrupted one, and the precomputed outputs and tables are identical.

Each check launches ``python -m torch.distributed.run --standalone`` (a free port of its own), as
tests/test_distributed.py does. Real testbed models, peft and wandb (offline).
"""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "train_compressibility.py"
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
ENV.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
# 5 optimizer steps of 4 samples (global batch 4: 2 per process under torchrun) on 3 short prompts.
SMALL = ["--target", "testbed-lm", "--drafter", "testbed-lm", "--train-prompts", "3", "--steps", "5", "--grad-accum", "4", "--input-tokens", "512",
         "--continuation-tokens", "16", "--eval-prompts", "1", "--eval-new-tokens", "16", "--eval-budgets", "0.25",
         "--temperatures", "0", "--checkpoint-every", "1", "--wandb-mode", "disabled"]
# The loss curve under torchrun against one process: per-step losses within this relative tolerance (gradients are
# summed in another order; measured: 7e-7 at most), the adapters within this absolute one (measured: 2e-5).
LOSS_RTOL, ADAPTER_ATOL = 1e-4, 1e-4


def launch(nproc: int, *argv, check: bool = True, logs: Path | None = None) -> subprocess.CompletedProcess:
    """``argv`` in one process (``nproc=0``) or under torchrun; ``logs``: rank 1's stdout and stderr go to files
    there (torchrun's --redirects), rank 0's to the result."""
    run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if logs is not None:
        run += ["--log-dir", str(logs), "--redirects", "1:3"]
    cmd = [sys.executable, *(run if nproc else []), *map(str, argv)]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def history(out: Path) -> list[dict]:
    last = max((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    return torch.load(last / "state.pt", weights_only=True)["history"]


def adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process; torchrun straight through; torchrun stopped after step 2 and rerun (each rerun a new job)."""
    d = tmp_path_factory.mktemp("dp")
    res = {"single": launch(0, SCRIPT, *SMALL, "--output-dir", d / "single"),
           "dp": launch(2, SCRIPT, *SMALL, "--wandb-mode", "offline", "--output-dir", d / "dp", logs=d / "logs"),
           "stopped": launch(2, SCRIPT, *SMALL, "--stop-after", "2", "--output-dir", d / "resumed"),
           "resumed": launch(2, SCRIPT, *SMALL, "--output-dir", d / "resumed")}
    return d, res


def test_torchrun_training_matches_one_process_at_the_same_global_batch(runs):
    d, res = runs
    one, dp = history(d / "single"), history(d / "dp")
    assert [h["step"] for h in dp] == [h["step"] for h in one] == [1, 2, 3, 4, 5]
    assert [h["lr"] for h in dp] == [h["lr"] for h in one]
    # Step 1 starts from the same adapter with the same samples and layouts, summed in the same order: exact.
    assert dp[0]["loss"] == one[0]["loss"]
    assert [h["loss"] for h in dp] == pytest.approx([h["loss"] for h in one], rel=LOSS_RTOL)
    a, b = adapter(d / "single"), adapter(d / "dp")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=ADAPTER_ATOL, rtol=0)
    assert one[-1]["loss"] != one[0]["loss"] and max(v.abs().max() for v in a.values()) > 10 * ADAPTER_ATOL
    # The table is computed by both processes (evaluate shards) and printed, written and logged by rank 0 alone.
    rows = [json.loads((d / r / "results.json").read_text())["rows"] for r in ("single", "dp")]
    assert rows[0] == rows[1]
    assert res["dp"].stdout.count("| temperature | policy |") == 1 and "LoRA compressibility" in res["dp"].stderr
    rank1 = sorted((d / "logs").rglob("1/std*.log"))
    assert [p.name for p in rank1] == ["stderr.log", "stdout.log"]
    assert [p.read_text() for p in rank1] == ["", ""]  # rank 1 prints nothing: no bars, warnings or table
    assert len(list((d / "dp" / "wandb").glob("offline-run-*"))) == 1


def test_torchrun_target_outputs_are_those_of_one_process(runs):
    from rift_ada.trainers.compressibility import load_target_outputs

    d, _ = runs
    (meta1, one), (meta2, dp) = (load_target_outputs(d / r / "targets") for r in ("single", "dp"))
    assert meta1 == meta2 and meta1["samples"] == 3  # 3 prompts on 2 processes: rank 0 has two, rank 1 one
    assert (d / "single" / "targets" / "meta.json").read_text() == (d / "dp" / "targets" / "meta.json").read_text()
    for x, y in zip(one, dp, strict=True):
        assert x.keys() == y.keys() and all(same_bytes(x[k], y[k]) for k in x)
    assert not (d / "dp" / "targets" / "samples.partial.pt").exists()


def test_torchrun_run_resumes_to_the_uninterrupted_run(runs):
    d, res = runs
    assert "stopped after step 2" in res["stopped"].stderr
    assert res["stopped"].stderr.count("stopped after step 2") == 1  # rank 0 alone
    dp, resumed = history(d / "dp"), history(d / "resumed")
    assert resumed == dp  # same processes, same order of sums: bit for bit
    a, b = adapter(d / "dp"), adapter(d / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_grad_accum_not_a_multiple_of_the_processes_is_one_line_from_rank_0(tmp_path):
    out = launch(2, SCRIPT, "--grad-accum", "3", "--output-dir", tmp_path, check=False)
    assert out.returncode != 0 and out.stdout == ""
    ours = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert ours == ["error: --grad-accum 3 (samples per optimizer step, the global batch) is not a multiple of the 2 "
                    "torchrun processes: use a multiple of 2"], out.stderr
    assert "exitcode  : 2" in out.stderr  # the processes exit 2 (torchrun itself exits 1, and may stop rank 1 first)
    assert f'File "{SCRIPT}"' not in out.stderr and "rift_ada/" not in out.stderr  # no worker traceback
    assert not (tmp_path / "checkpoints").exists()


DRIVER = '''
import sys

import numpy as np
import torch

from rift_ada import distributed
from rift_ada.data import build_tasks, encode
from rift_ada.layout import CacheLayout
from rift_ada.models import load_pair
from rift_ada.replay import ReplayTable
from rift_ada.replay.build import Builder, TableSpec, build_tables
from rift_ada.speculative import Decoding
from rift_ada.trainers.compressibility import build_target_outputs


def main(prefix):
    torch.set_num_threads(1)
    world = distributed.init("cpu")
    try:
        pair = load_pair("testbed-lm", "testbed-lm")
        tasks = build_tasks(pair.tokenizer, "low", n=3, input_tokens=512, seed=0)
        prompts = [encode(pair.tokenizer, t.prompt) for t in tasks]
        # Sampled continuations: each table's seed must follow it to whichever process builds it.
        builder = Builder("testbed-lm", "testbed-lm", CacheLayout("rift", budget=96, refresh_grid=4),
                          Decoding(4, 1.0), 32)
        specs = [TableSpec(f"t{i}", tuple(ids), 10 + i) for i, ids in enumerate(prompts)]
        paths = build_tables(builder, specs, f"{prefix}.tables", pair, progress=False)
        tables = [ReplayTable.load(p) for p in paths]
        np.savez(f"{prefix}.{distributed.rank()}.npz", q=np.stack([t.q for t in tables]),
                 tokens=np.stack([t.tokens for t in tables]), world=world)
        build_target_outputs(pair.target, prompts, 12, f"{prefix}.targets", top_k=8, temperature=1.0, seed=5,
                             progress=False)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
'''


def test_replay_tables_and_sampled_target_outputs_under_torchrun(tmp_path):
    from rift_ada import distributed
    from rift_ada.trainers.compressibility import load_target_outputs

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = launch(2, script, tmp_path / "dp")
    assert out.stdout == "", out.stdout
    ranks = [np.load(tmp_path / f"dp.{r}.npz") for r in (0, 1)]
    assert int(ranks[0]["world"]) == 2
    assert distributed.world_size() == 1  # the reference runs alone, in this process
    runpy.run_path(str(script))["main"](str(tmp_path / "one"))
    one = np.load(tmp_path / "one.0.npz")
    assert int(one["world"]) == 1 and one["q"].shape[0] == 3
    for r in ranks:  # every process sees every table, each the one process builds, whoever built it
        for key in ("q", "tokens"):
            assert r[key].dtype == one[key].dtype and r[key].tobytes() == one[key].tobytes(), key
    (_, a), (_, b) = (load_target_outputs(tmp_path / f"{p}.targets") for p in ("dp", "one"))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert all(same_bytes(x[k], y[k]) for k in x)
