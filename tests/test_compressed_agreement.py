import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "compressed_agreement.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_the_target_predicts_its_own_continuation_and_compression_costs(tmp_path):
    out = tmp_path / "agreement.json"
    res = run("--target", "testbed-lm", "--models", "testbed-lm-target", "testbed-lm-draft", "--prompts", "1",
              "--input-tokens", "1024", "--new-tokens", "24", "--budgets", "0.0625", "--output", str(out),
              "--targets-dir", str(tmp_path / "targets"))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {(r["model"], r["budget_fraction"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(m, b) for m in ("testbed-lm-target", "testbed-lm-draft") for b in (None, 0.0625)}
    # The target on its full cache reads its own greedy continuation: every argmax agrees.
    assert rows["testbed-lm-target", None]["top1"] == 1.0 and rows["testbed-lm-target", None]["accept"] > 0.5
    for r in rows.values():
        assert 0 <= r["accept"] <= r["top1"] + 0.5 and 0 <= r["top1"] <= 1
    # The stored target outputs are reused (no rebuild), and other prompts are refused against them.
    again = run("--target", "testbed-lm", "--models", "testbed-lm-draft", "--prompts", "1", "--input-tokens", "1024",
                "--new-tokens", "24", "--budgets", "0.0625", "--targets-dir", str(tmp_path / "targets"))
    assert again.returncode == 0 and "target outputs" not in again.stderr
    other = run("--target", "testbed-lm", "--models", "testbed-lm-draft", "--prompts", "1", "--input-tokens", "1024",
                "--new-tokens", "24", "--seed", "5", "--targets-dir", str(tmp_path / "targets"))
    assert other.returncode == 2 and "other prompts" in other.stderr and "Traceback" not in other.stderr


def test_rift_dyn_rows_reselect(tmp_path):
    """--period adds a RIFT-dyn row per budget; one whose period outlasts the continuation never re-selects, so it
    reads exactly the RIFT-stat cache."""
    common = ["--target", "testbed-lm", "--models", "testbed-lm-draft", "--prompts", "1", "--input-tokens", "1024",
              "--new-tokens", "24", "--budgets", "0.0625", "--targets-dir", str(tmp_path / "targets")]
    rows = {}
    for period in ("4", "100"):
        out = tmp_path / f"p{period}.json"
        res = run(*common, "--period", period, "--output", str(out))
        assert res.returncode == 0, res.stderr[-2000:]
        assert "rift-dyn 6.25%" in res.stdout
        rows[period] = {(r["budget_fraction"], r["period"]): r for r in json.loads(out.read_text())["rows"]}
        assert set(rows[period]) == {(None, None), (0.0625, None), (0.0625, int(period))}
    assert rows["100"][0.0625, 100]["accept"] == rows["100"][0.0625, None]["accept"]
    assert rows["4"][0.0625, 4]["accept"] != rows["4"][0.0625, None]["accept"]


def test_bad_budgets_are_refused():
    res = run("--budgets", "0")
    assert res.returncode == 2 and "--budgets are fractions" in res.stderr
    res = run("--period", "0")
    assert res.returncode == 2 and "--period must be >= 1" in res.stderr
