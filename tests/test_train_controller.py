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
    args = ["--target", "testbed-lm", "--drafter", "testbed-lm", "--train-prompts", "3", "--eval-prompts", "2",
            "--input-tokens", "512", "--budget", "64",
            "--max-new-tokens", "64", "--ppo-timesteps", "256", "--lams", "0.5", "--periods", "16", "32",
            "--acc-thresholds", "0.5", "--logistic-thresholds", "0.5", "--horizon", "3", "--label-every", "1",
            "--label-margin", "0", "--entropy-quantiles", "0.5", "--learners", "ppo,dqn", "--dqn-timesteps", "128",
            "--reward", "time", "--oracle-lams", "2", "--output-dir", str(out)]
    res = subprocess.run([sys.executable, str(SCRIPT), *args], env=ENV, capture_output=True, text=True, timeout=900,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fewer refreshes than periodic at matched AL" in res.stdout
    rows = list(csv.DictReader((out / "tradeoff.csv").open()))
    metrics = json.loads((out / "metrics.json").read_text())
    both_classes = 0 < metrics["counterfactual"]["positive_rate"] < 1
    assert {r["family"] for r in rows} == {"never", "periodic", "threshold", "entropy", "ppo", "dqn", "oracle"} | (
        {"logistic"} if both_classes else set())
    oracle = next(r for r in rows if r["family"] == "oracle")
    assert float(oracle["knob"]) == 2 and oracle["al_gain"] != "", "the oracle is compared with periodic too"
    assert all(float(r["acceptance_length"]) >= 1.0 for r in rows)
    entropy = next(r for r in rows if r["family"] == "entropy")
    assert 0 <= float(entropy["knob"]) <= 1 and entropy["al_gain"] != "", "compared with periodic like the others"
    assert (out / "tradeoff.png").stat().st_size > 1000 and (out / "tradeoff_time.png").stat().st_size > 1000
    assert Path(metrics["controller"]).exists()
    assert metrics["reward"] == "time" and all(v > 0 for v in metrics["costs"].values())
    assert all(r["modelled_tokens_per_s"] > 0 for r in metrics["rows"])
    from rift_ada.refresh import DQNController, load_controller

    dqn = load_controller(out / "state" / "dqn-lam0.5.pt")  # the DQN run's export, as the sweep loaded it
    assert isinstance(dqn, DQNController) and dqn.lam == 0.5
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    tables = [json.loads(t.read_text()) for t in runs[0].glob("files/media/table/**/*.table.json")]
    tradeoff = [t for t in tables if t["columns"][:3] == ["family", "knob", "acceptance_length"]]
    assert len(tradeoff) == 1, "the tradeoff table is in the offline run"
    assert len(tradeoff[0]["data"]) == len(rows)
    assert sum(t["columns"] == ["step", "lineKey", "lineVal"] for t in tables) == 2, "and its two line plots"
    assert len(list(runs[0].glob("files/media/images/**/*.png"))) == 2, "both plots as images"


def test_help_and_bad_values():
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, env=ENV)
    assert res.returncode == 0 and "--ppo-timesteps" in res.stdout and "--wandb-mode" in res.stdout
    assert all(o in res.stdout for o in ("--learners", "--dqn-timesteps", "--reward", "--entropy-quantiles"))
    res = subprocess.run([sys.executable, str(SCRIPT), "--budget", "0"], capture_output=True, text=True, env=ENV)
    assert res.returncode == 2 and "--budget must be >= 1" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, str(SCRIPT), "--acc-thresholds", "1.5"], capture_output=True, text=True,
                         env=ENV)
    assert res.returncode == 2 and "thresholds" in res.stderr
    res = subprocess.run([sys.executable, str(SCRIPT), "--learners", "ppo,a2c"], capture_output=True, text=True,
                         env=ENV)
    assert res.returncode == 2 and "--learners: a2c" in res.stderr and len(res.stderr.strip().splitlines()) == 1



def test_paper_preset_sets_the_paper_setting_and_the_testbed_refuses_it(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_controller
    finally:
        sys.path.remove(str(SCRIPT.parent))
    paper = train_controller.parse_args(["--preset", "paper", "--budget", "4096"])  # an explicit option wins
    assert (paper.input_tokens, paper.max_new_tokens, paper.budget, paper.draft_length, paper.temperature) == \
        (32768, 4096, 4096, 11, 1.0)
    assert "sort" in paper.task and max(paper.periods) == 4096
    cpu = train_controller.parse_args([])
    assert (cpu.input_tokens, cpu.max_new_tokens, cpu.temperature) == (2048, 256, 0.0)
    res = subprocess.run([sys.executable, str(SCRIPT), "--preset", "paper", "--output-dir", str(tmp_path / "p")],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: --input-tokens + --max-new-tokens needs 36864")
