"""The pieces resumable jobs are made of: an output folder's state, units, and a W&B run that resumes (real wandb,
offline)."""

import json
import re

import pytest

from rift_ada.resume import open_state
from rift_ada.trainers.wandb_logging import ResumableRun


def test_a_previous_run_is_refused_resumed_with_its_settings_or_overwritten(tmp_path):
    out = tmp_path / "run"
    state = open_state(out, {"seed": 0}, resume=False, overwrite=False, outputs=("result.csv",))
    assert state.unit("a", lambda: {"x": 0.1 + 0.2})["x"] == 0.1 + 0.2
    (out / "result.csv").write_text("old")
    (out / "wandb").mkdir()
    with pytest.raises(ValueError, match="--resume to continue it, --overwrite to start over"):
        open_state(out, {"seed": 0}, resume=False, overwrite=False, outputs=("result.csv",))
    with pytest.raises(ValueError, match=r"--seed 0 -> 1"):
        open_state(out, {"seed": 1}, resume=True, overwrite=False)

    resumed = open_state(out, {"seed": 0}, resume=True, overwrite=False)
    assert resumed.unit("a", lambda: pytest.fail("a finished unit is not redone"))["x"] == 0.1 + 0.2
    assert resumed.unit("a", lambda: {"x": 2}, key={"n": 1})["x"] == 2, "another key redoes the unit"

    fresh = open_state(out, {"seed": 1}, resume=False, overwrite=True, outputs=("result.csv",))
    assert not fresh.has("a") and not (out / "result.csv").exists() and (out / "wandb").is_dir()
    assert not list(out.rglob("*.tmp*")), "atomic writes leave no temporary files"


def test_a_resumed_wandb_run_keeps_its_id_and_counts_steps_on(tmp_path):
    kw = dict(project="rift-ada-test", mode="offline", dir=str(tmp_path))
    first = ResumableRun(tmp_path / "wandb.json", **kw)
    first.log({"x": 1})
    first.log({"x": 2})
    first.finish()
    second = ResumableRun(tmp_path / "wandb.json", **kw)
    second.log({"x": 3})
    second.finish()
    assert second.id == first.id and second.resumed and not first.resumed
    assert json.loads((tmp_path / "wandb.json").read_text()) == {"id": first.id, "step": 3}
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # offline-run-<date>_<time>-<id>; wandb appends -1 to the second folder when both sessions start in the same second
    ids = [re.fullmatch(r"offline-run-\d{8}_\d{6}-([0-9a-z]+)(-\d+)?", f.name) for f in folders]
    assert all(ids) and [m.group(1) for m in ids] == [first.id] * 2, [f.name for f in folders]
    assert all((f / f"run-{first.id}.wandb").is_file() for f in folders)


def test_a_start_that_failed_before_any_work_is_no_previous_run(tmp_path):
    out = tmp_path / "run"
    open_state(out, {"target": "typo"}, resume=False, overwrite=False)  # e.g. the model failed to load next
    state = open_state(out, {"target": "testbed"}, resume=False, overwrite=False)
    assert json.loads(state.path("config.json").read_text()) == {"target": "testbed"}
