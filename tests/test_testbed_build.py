"""The testbed recipe: a staged build that resumes bit for bit, a checkpoint that is read without running pickled
code, and the check's language-model fields."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rift_ada.data import build_tasks, load_corpus
from rift_ada.testbed.check import code_scores, code_windows, run_check

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def build(out, work, *extra, wait=True):
    cmd = [sys.executable, str(ROOT / "experiments" / "build_testbed.py"), "--quick", "--no-compose", "--threads", "1",
           "--output-dir", str(out), "--work-dir", str(work), *extra]
    if not wait:  # its own process group, so that a kill reaches everything it started
        return subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def digests(folder):
    return {role: hashlib.sha256((Path(folder) / f"lm-{role}" / "model.safetensors").read_bytes()).hexdigest()
            for role in ("target", "draft")}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # three builds, each with its own timeout
def test_build_resumes_bit_for_bit(tmp_path):
    build(tmp_path / "a", tmp_path / "wa")
    reference = digests(tmp_path / "a")
    log = json.loads((tmp_path / "a" / "training_log.json").read_text())
    assert log["initialisation"].startswith("random") and len(log["stage_seconds"]) == len(log["recipe"])

    # Stopped at a stage boundary, resumed and killed in the middle of the next stage (a checkpoint after every
    # step), then resumed again: both resume paths in one chain of builds.
    work = tmp_path / "wb"
    build(tmp_path / "b", work, "--stop-after-stage", "0")
    assert not (tmp_path / "b" / "lm-target").exists() and (work / "stage-0" / "done.json").is_file()
    proc = build(tmp_path / "b", work, "--resume", "--checkpoint-minutes", "0", wait=False)
    deadline = time.monotonic() + 300
    try:
        while not (work / "checkpoint.pt").is_file():
            assert proc.poll() is None, f"the build ended (exit {proc.returncode}) before it could be interrupted"
            assert time.monotonic() < deadline, "no mid-stage checkpoint within 300 s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (tmp_path / "b" / "lm-target").exists() and not (work / "stage-1" / "done.json").is_file()
    build(tmp_path / "b", work, "--resume")
    assert digests(tmp_path / "b") == reference


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the build's own timeout is 900 s
def test_quick_build_runs_through_composition_and_check(tmp_path):
    """The --quick recipe end to end: trained models, the copier's settings with pinned checksums, the composed pair
    (in its own cache) and the testbed check on it."""
    from rift_ada.testbed.composed import composed_folder, read_settings, weights_sha256
    from rift_ada.models import load_model

    env = dict(ENV, RIFT_ADA_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, str(ROOT / "experiments" / "build_testbed.py"), "--quick", "--threads", "1",
           "--output-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "target_copy_accuracy" in res.stdout and "draft_agreement" in res.stdout  # the check's report
    settings = read_settings(tmp_path / "out")
    assert set(settings["composed_sha256"]) == {"target", "draft"} and len(settings["calibration"]) == 4
    os.environ["RIFT_ADA_CACHE"] = env["RIFT_ADA_CACHE"]
    try:
        for role in ("target", "draft"):
            folder = composed_folder(role, tmp_path / "out")
            assert folder.parent == tmp_path / "cache"  # composed by the build, found again here
            assert weights_sha256(load_model(str(folder))) == settings["composed_sha256"][role]
    finally:
        del os.environ["RIFT_ADA_CACHE"]


def test_build_refuses_to_overwrite_a_build_without_resume(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "checkpoint.pt").write_bytes(b"")
    cmd = [sys.executable, str(ROOT / "experiments" / "build_testbed.py"), "--quick", "--no-check",
           "--output-dir", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w")]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "--resume" in res.stderr.strip().splitlines()[-1]


class _Planted:
    """Unpickled, this would make a folder: the harmless stand-in for code a planted checkpoint runs."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_planted_pickle_checkpoint_is_refused_without_running_it(tmp_path):
    import torch

    from rift_ada.testbed.train import read_checkpoint

    work, marker = tmp_path / "w", tmp_path / "ran"
    work.mkdir()
    torch.save({"stage": 0, "step": 1, "models": {}, "optimizers": {}, "rng": _Planted(marker), "nrng": {},
                "running": {}}, work / "checkpoint.pt")
    cmd = [sys.executable, str(ROOT / "experiments" / "build_testbed.py"), "--quick", "--no-compose", "--resume",
           "--threads", "1", "--output-dir", str(tmp_path / "o"), "--work-dir", str(work)]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert last.startswith(f"error: {work / 'checkpoint.pt'}: refused") and "posix.mkdir" in last, last
    assert not marker.exists(), "the planted code ran"
    # A bare pickle (torch's legacy format) is refused the same way, and so is a damaged archive.
    import pickle

    (work / "checkpoint.pt").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ValueError, match="refused") as err:
        read_checkpoint(work / "checkpoint.pt")
    assert "\n" not in str(err.value) and not marker.exists()
    (work / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match="truncated, corrupt.*delete it"):
        read_checkpoint(work / "checkpoint.pt")


def test_code_scores_are_teacher_forced_top1_and_nll(tokenizer, testbed_target, testbed_draft):
    windows = code_windows(tokenizer, load_corpus(split="eval"), n=2, length=256)
    assert [len(w) for w in windows] == [257, 257]
    assert windows == code_windows(tokenizer, load_corpus(split="eval"), n=2, length=256)
    s = code_scores(testbed_target, windows)
    # Recomputed from each window's logits: hits and summed NLL over all 512 predicted tokens.
    import torch

    hits = nll = 0.0
    for w in windows:
        ids = torch.tensor(w)
        with torch.no_grad():
            logits = testbed_target(input_ids=ids[None, :-1]).logits[0]
        hits += (logits.argmax(-1) == ids[1:]).sum().item()
        nll += torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()
    assert s["top1"] == hits / 512 and s["nll"] == pytest.approx(nll / 512, rel=1e-5)
    assert code_scores(testbed_draft, windows) != s


def test_check_reports_family_and_code_fields(tokenizer, testbed_target, testbed_draft):
    low = build_tasks(tokenizer, "low", n=1, input_tokens=1024, seed=1)
    high = build_tasks(tokenizer, "high", n=1, input_tokens=1024, seed=1)
    sort = build_tasks(tokenizer, "sort", n=1, input_tokens=1024, seed=1)
    windows = code_windows(tokenizer, load_corpus(split="eval"), n=1, length=128)
    res = run_check(testbed_target, testbed_draft, tokenizer, low, new_tokens=16, progress=False, high_tasks=high,
                    sort_tasks=sort, code_windows=windows)
    for key in ("draft_agreement_high", "target_sort_accuracy", "target_code_top1", "target_code_nll",
                "draft_code_top1"):
        assert key in res
    # Each field is what its definition computes on the same inputs.
    alone = run_check(testbed_target, testbed_draft, tokenizer, high, new_tokens=16, progress=False)
    assert res["draft_agreement_high"] == alone["draft_agreement"]
    sort_alone = run_check(testbed_target, testbed_draft, tokenizer, sort, new_tokens=16, progress=False)
    assert res["target_sort_accuracy"] == sort_alone["target_copy_accuracy"]
    assert res["target_code_top1"] == code_scores(testbed_target, windows)["top1"]
