import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "train_controller.py"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true")


def test_main_job_small_run_writes_wandb_offline_table_and_outputs(tmp_path):
    out = tmp_path / "run"
    args = ["--train-prompts", "3", "--eval-prompts", "2", "--input-tokens", "1024", "--budget", "128",
            "--max-new-tokens", "64", "--ppo-timesteps", "256", "--lams", "0.5", "--periods", "16", "32",
            "--acc-thresholds", "0.5", "--logistic-thresholds", "0.5", "--horizon", "3", "--label-every", "1",
            "--label-margin", "0", "--output-dir", str(out)]
    res = subprocess.run([sys.executable, str(SCRIPT), *args], env=ENV, capture_output=True, text=True, timeout=900,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fewer refreshes than periodic at matched AL" in res.stdout
    rows = list(csv.DictReader((out / "tradeoff.csv").open()))
    metrics = json.loads((out / "metrics.json").read_text())
    both_classes = 0 < metrics["counterfactual"]["positive_rate"] < 1
    assert {r["family"] for r in rows} == {"never", "periodic", "threshold", "ppo"} | ({"logistic"} if both_classes
                                                                                       else set())
    assert all(float(r["acceptance_length"]) >= 1.0 for r in rows)
    assert (out / "tradeoff.png").stat().st_size > 1000
    assert Path(metrics["controller"]).exists()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    tables = [json.loads(t.read_text()) for t in runs[0].glob("files/media/table/**/*.table.json")]
    tradeoff = [t for t in tables if t["columns"][:3] == ["family", "knob", "acceptance_length"]]
    assert len(tradeoff) == 1, "the tradeoff table is in the offline run"
    assert len(tradeoff[0]["data"]) == len(rows)
    assert any(t["columns"] == ["step", "lineKey", "lineVal"] for t in tables), "and its line plot"


def test_help_and_bad_values():
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, env=ENV)
    assert res.returncode == 0 and "--ppo-timesteps" in res.stdout and "--wandb-mode" in res.stdout
    res = subprocess.run([sys.executable, str(SCRIPT), "--budget", "0"], capture_output=True, text=True, env=ENV)
    assert res.returncode == 2 and "--budget must be >= 1" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, str(SCRIPT), "--acc-thresholds", "1.5"], capture_output=True, text=True,
                         env=ENV)
    assert res.returncode == 2 and "thresholds" in res.stderr
