"""The main job, killed (SIGKILL) mid-run and resumed with --resume, ends with the same tradeoff.csv as an
uninterrupted run, and its W&B offline run resumes under the same id. Real models, real PPO, real wandb offline."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "train_controller.py"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true")
TINY = ["--target", "testbed-lm", "--drafter", "testbed-lm", "--train-sources", "stdlib,numpy",
        "--prompts-per-source", "1", "--eval-prompts", "1", "--input-tokens", "512", "--budget", "64",
        "--draft-length", "4", "--max-new-tokens", "48", "--ppo-timesteps", "64", "--lams", "1", "--periods", "16",
        "--acc-thresholds", "0.5", "--logistic-thresholds", "0.5", "--label-price", "0.5", "--oracle-lams", "1",
        "--entropy-quantiles", "0.5", "--learners", "ppo", "--temperature", "0", "--tree-decisions", "0.5"]


def job(out, *extra, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *TINY, "--output-dir", str(out), *extra], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def run_until(out, unit: str, timeout=600):
    """Start the job and SIGKILL it (with its process group) as soon as state file ``unit`` appears."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *TINY, "--output-dir", str(out)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not (out / "state" / unit).exists():
            assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before writing {unit}"
            assert time.monotonic() < deadline, f"no {unit} after {timeout} s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wandb_ids(out):
    return [p.name.rsplit("-", 1)[1] for p in sorted((out / "wandb").glob("offline-run-*"))]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several jobs, each with its own timeout
def test_killed_job_resumes_to_the_same_tradeoff_csv_and_wandb_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    res = job(straight)
    assert res.returncode == 0, res.stderr[-3000:]

    run_until(killed, "tree.json")  # a kill after the tables and the tree, during the next fit
    assert not (killed / "tradeoff.csv").exists()
    run_id = json.loads((killed / "state" / "wandb.json").read_text())["id"]
    refused = job(killed)  # a previous run is never silently overwritten
    assert refused.returncode == 2 and "--resume" in refused.stderr and "Traceback" not in refused.stderr
    resumed = job(killed, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and "3 tables" in resumed.stderr

    assert (killed / "tradeoff.csv").read_text() == (straight / "tradeoff.csv").read_text()
    assert wandb_ids(killed) == [run_id, run_id], "both sessions log to one W&B run"
    assert wandb_ids(straight) != [run_id]
    last = sorted((killed / "wandb").glob("offline-run-*"))[-1]
    assert list(last.glob("files/media/table/**/*.table.json")), "the resumed session logged the tradeoff table"

    again = job(killed, "--resume")  # a finished run resumes to nothing
    assert again.returncode == 0 and "nothing to resume" in again.stdout
    other = job(killed, "--resume", "--ppo-timesteps", "128")
    assert other.returncode == 2 and "--ppo-timesteps 64 -> 128" in other.stderr
