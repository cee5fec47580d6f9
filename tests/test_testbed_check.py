import json
import os
import subprocess
import sys

from rift_ada.data import build_tasks
from rift_ada.testbed.check import copy_accuracy, run_check

ENV = dict(os.environ, HF_HUB_OFFLINE="1")


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "rift_ada.testbed", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_copy_accuracy_counts_positions():
    assert copy_accuracy([1, 2, 3, 4], [1, 2, 9, 4, 5], 4) == 0.75
    assert copy_accuracy([1, 2], [1, 2, 3, 4], 4) == 0.5  # stopping early counts as wrong
    assert copy_accuracy([1, 2, 3], [1, 2], 8) == 1.0  # scored over the reference that exists


def test_check_cli_json_fields():
    out = cli("check", "--json", "--prompts", "2", "--new-tokens", "24", "--input-tokens", "1024")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert set(res) >= {"target_copy_accuracy", "draft_copy_accuracy", "draft_agreement", "prompts"}
    assert res["prompts"] == 2
    for k in ("target_copy_accuracy", "draft_copy_accuracy", "draft_agreement"):
        assert 0.0 <= res[k] <= 1.0


def test_model_against_itself_agrees_fully(tokenizer, testbed_target):
    tasks = build_tasks(tokenizer, "low", n=1, input_tokens=1024, seed=3)
    res = run_check(testbed_target, testbed_target, tokenizer, tasks, new_tokens=16, progress=False)
    assert res["draft_agreement"] == 1.0
    assert res["target_copy_accuracy"] == res["draft_copy_accuracy"]


def test_check_cli_bad_input_is_one_line():
    out = cli("check", "--task", "medium", "--prompts", "1")
    assert out.returncode == 2 and "unknown task family 'medium'" in out.stderr and "Traceback" not in out.stderr
    out = cli("check", "--prompts", "1", "--input-tokens", "9000")
    assert out.returncode == 2 and "context is" in out.stderr and "Traceback" not in out.stderr
    out = cli("check", "--prompts", "1", "--target", "/nonexistent/model")
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr
