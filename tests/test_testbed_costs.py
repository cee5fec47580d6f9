"""experiments/testbed_costs.py on a short prompt: every row measured, and the figures it derives consistent."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_costs_script_measures_every_row(tmp_path):
    out = tmp_path / "costs.json"
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "testbed_costs.py"), "--target", "testbed-lm",
                          "--drafter", "testbed-lm-draft", "--input-tokens", "512", "--budget", "128", "--steps", "24",
                          "--greedy-tokens", "16", "--output", str(out)],
                         env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert res == json.loads(run.stdout.strip().splitlines()[-1])
    assert res["prompt_tokens"] >= 512 and res["budget"] == 128
    for key in ("target_prefill_s", "draft_prefill_s", "target_step_ms", "draft_step_ms"):
        assert res[key] > 0, key
    rift = res["rift"]
    assert rift["draft_ms_per_step"] > 0 and rift["verify_ms"] > 0 and 1 <= rift["acceptance_length"] <= 12
    assert rift["rounds"] >= 2  # 24 tokens at k = 11 take at least two rounds
    assert res["greedy"]["tokens"] == 16 and res["greedy"]["tokens_per_s"] > 0


def test_costs_script_refuses_bad_input_in_one_line():
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "testbed_costs.py"), "--greedy-tokens", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--greedy-tokens must be >= 0" in run.stderr and "Traceback" not in run.stderr
