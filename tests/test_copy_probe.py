"""experiments/copy_probe.py: the first wrong token of a testbed copy, on the pinned pair and on a copier composed in
memory with changed settings."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "copy_probe.py"
ARGS = ["--source-dir", "pip", "--input-tokens", "1024", "--prompts", "2", "--prompt", "1", "--tokens", "64"]


def run(*extra):
    res = subprocess.run([sys.executable, str(SCRIPT), *ARGS, *extra], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_pinned_pair_copies_the_whole_prompt_and_not_without_its_source():
    out = run("--keep", "300", "100000", "--explain")
    short, whole = out["rows"]
    assert whole["keep"] == out["prompt_tokens"] and whole["first_wrong"] == 64  # the 1K copy is exact
    assert "match_head" not in whole  # nothing went wrong, nothing to explain
    assert short["keep"] == 300 and short["first_wrong"] < 64  # the source is cut off: nothing to copy from
    seen = short["match_head"]
    assert len(seen["top"]) == 3 and all(1 <= k["back"] <= 300 for k in seen["top"])
    assert seen["top"][0]["score"] >= seen["top"][1]["score"] >= seen["top"][2]["score"]
    assert seen["rms_query"] > 0 and seen["rms_median"] > 0


def test_a_copier_without_its_boost_stops_copying():
    # boost=0 leaves the trained model's logits (testbed/circuit.py): it copies only as far as its own prior goes
    pinned, changed = run(), run("--set", "boost=0")
    assert changed["changes"] == {"boost": 0} and pinned["rows"][0]["first_wrong"] == 64
    assert changed["rows"][0]["first_wrong"] < 64


def test_bad_settings_fail_in_one_line():
    for bad, says in ((["--set", "nope=1"], "KEY one of"), (["--set", "boost=x"], "VALUE must be"),
                      (["--prompt", "5"], "--prompt must be in")):
        res = subprocess.run([sys.executable, str(SCRIPT), *ARGS, *bad], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr
