"""experiments/paper_regime.py at a small scale: every file written, the figures consistent with each other and with
the replay of the same tables, the run resumable, bad input refused in one line."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rift_ada.layout import covering_lookahead
from rift_ada.refresh.rules import ThresholdController
from rift_ada.replay import ReplayTable

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--input-tokens", "1024", "--reference-tokens", "512", "--max-new-tokens", "96", "--budget", "256",
         "--budgets", "128", "--prompts", "2", "--temperatures", "0", "1", "--refresh-grid", "8", "--dyn-period", "16",
         "--periods", "8", "16", "32", "64", "--bin", "32", "--episodes", "4", "--resamples", "200",
         "--oracle-lams", "1", "4", "--threads", "1"]


def run(args, tmp_path, timeout=900):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "paper_regime.py"), *args],
                          env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"), capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path)


def rows(path):
    return list(csv.DictReader(open(path)))


@pytest.mark.slow
def test_paper_regime_small_run_writes_consistent_figures_and_resumes(tmp_path):
    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    ThresholdController([("acc_mean", "<", 0.5)], min_gap=8).save(ctrl / "controller-threshold.json")
    res = run([*SMALL, "--self", "--controllers", str(ctrl), "--output-dir", "out"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "out"
    for name in ("staleness.csv", "staleness.png", "retention.csv", "budgets.csv", "budgets.png", "tradeoff-t0.csv",
                 "tradeoff-t0.png", "tradeoff-t1.csv", "tradeoff-t1.png", "summary.json"):
        assert (out / name).is_file(), name
    assert list((out / "wandb").glob("offline-run-*")), "a W&B offline run"
    retention = rows(out / "retention.csv")
    whole = {(r["temperature"], r["policy"]): r for r in retention if r["drafter"] == "external"}
    own = {(r["temperature"], r["policy"]): r for r in retention if r["drafter"] == "self"}
    for t in ("0.0", "1.0"):
        # the target drafting for itself with a full cache accepts every token: the rounds' own cap
        assert float(own[t, "full"]["acceptance_length"]) >= float(whole[t, "full"]["acceptance_length"])
        assert float(own[t, "rift-stat"]["acceptance_length"]) <= float(own[t, "full"]["acceptance_length"])
        assert float(whole[t, "full"]["al_vs_full"]) == 1.0
        assert float(whole[t, "rift-dyn"]["refreshes_per_1k"]) > 0 == float(whole[t, "rift-stat"]["refreshes_per_1k"])
        trade = {(r["family"], r["knob"]): r for r in rows(out / f"tradeoff-t{t[0]}.csv")}
        # the same tables replayed two ways: never = rift-stat, periodic at the dyn period = rift-dyn, full = full
        for fam, knob, policy in (("never", "-", "rift-stat"), ("periodic", "16", "rift-dyn"), ("full", "-", "full")):
            assert float(trade[fam, knob]["acceptance_length"]) == pytest.approx(
                float(whole[t, policy]["acceptance_length"]), rel=1e-6), (t, fam)
        assert "threshold" in {f for f, _ in trade} and "oracle" in {f for f, _ in trade}
    budgets = {(r["temperature"], r["policy"], r["budget"]): r for r in rows(out / "budgets.csv")}
    assert float(budgets["0.0", "rift-stat", "256"]["acceptance_length"]) == pytest.approx(
        float(whole["0.0", "rift-stat"]["acceptance_length"]))
    assert ("0.0", "rift-dyn", "128") in budgets and not any(t == "1.0" for t, _, _ in budgets)
    bins = [r for r in rows(out / "staleness.csv")
            if (r["temperature"], r["drafter"], r["policy"]) == ("0.0", "external", "window")]
    assert [int(r["bin_start"]) for r in bins] == [0, 32, 64]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["staleness"]) == 4 and all("SnapKV prefill-only minus window" in s for s in summary["staleness"])
    tables = sorted((out / "tables-t0").glob("*.safetensors"))
    assert len(tables) == 2 * 7  # per prompt: the main table, snapkv, window, budget 128, and the target's three
    stamps = [p.stat().st_mtime_ns for p in tables]
    # no --lookahead: the selection covers a dyn period on the grid (7 stale + 16 + k 11 = 34 tokens: 64)
    assert ReplayTable.load(tables[0]).header["layout"]["lookahead"] == covering_lookahead(16, 8, 11) == 64
    again = run([*SMALL, "--self", "--controllers", str(ctrl), "--output-dir", "out"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.stat().st_mtime_ns for p in tables] == stamps, "a second run reuses every table"
    assert rows(out / "retention.csv") == retention
    check_on_the_real_decoder(tmp_path, ctrl)
    # another layout of the same prompts: the stored continuation is reused, only the rows are computed again
    cont = sorted((out / "tables-t0").glob("*.continuation.npz"))
    cont_stamps = [p.stat().st_mtime_ns for p in cont]
    third = run([*SMALL, "--temperatures", "0", "--lookahead", "32", "--budgets", "--output-dir", "out"], tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert len(cont) == 2 and [p.stat().st_mtime_ns for p in cont] == cont_stamps
    for path in (p for p in tables if p.name.count(".") == 1):  # the main tables, rebuilt with the new layout
        table = ReplayTable.load(path)
        assert table.header["layout"]["lookahead"] == 32
        with np.load(path.with_name(path.stem + ".continuation.npz")) as z:
            assert (z["tokens"] == table.tokens).all()


def check_on_the_real_decoder(tmp_path, ctrl):
    """experiments/regime_check.py on the run: greedy, the real decoder's rounds are the replay's (AL and refreshes
    equal); sampling, one decode lands inside the replay's range; a temperature the run lacks is refused."""
    def check(*args):
        res = subprocess.run([sys.executable, str(ROOT / "experiments" / "regime_check.py"), "--run", "out",
                              "--controllers", str(ctrl), "--periods", "8", "16", "--threads", "1", *args],
                             env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600,
                             cwd=tmp_path)
        return res, (json.loads((tmp_path / "out" / f"check-t{args[1]}.json").read_text())
                     if res.returncode == 0 else None)

    res, greedy = check("--temperature", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    trade = {(r["family"], r["knob"]): r for r in rows(tmp_path / "out" / "tradeoff-t0.csv")}
    for name, row in greedy["summary"].items():
        assert row["prompts"] == 2 and row["inside"] == 2, name
        assert row["real_al"] == pytest.approx(row["replay_al"]) and row["real_refreshes_per_1k"] == pytest.approx(
            row["replay_refreshes_per_1k"]), name
    assert greedy["summary"]["periodic-16"]["replay_al"] == pytest.approx(
        float(trade["periodic", "16"]["acceptance_length"]), rel=1e-6)
    assert greedy["summary"]["threshold"]["real_refreshes_per_1k"] > 0
    assert all(u["tokens_shared_with_table"] == u["tokens"] == 96 for u in greedy["units"].values())
    # the savings against the run's replayed periodic curve: the tradeoff's own for the replayed point
    assert greedy["summary"]["threshold"]["replay_savings"] == pytest.approx(
        float(trade["threshold", "-"]["refresh_savings"]))
    assert greedy["summary"]["threshold"]["real_savings"] == pytest.approx(
        greedy["summary"]["threshold"]["replay_savings"])
    res, sampled = check("--temperature", "1", "--prompts", "1", "--episodes", "16")
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(sampled["units"]) == {"p000/periodic-8", "p000/periodic-16", "p000/threshold"}
    lo, hi = sampled["units"]["p000/threshold"]["replay_al_range"]
    assert lo <= sampled["units"]["p000/threshold"]["real_al"] <= hi and lo < hi
    res, _ = check("--temperature", "0.5")
    assert res.returncode == 2 and "not 0.5" in res.stderr and "Traceback" not in res.stderr


def test_paper_regime_refuses_bad_input_in_one_line(tmp_path):
    for args, msg in ((["--budget", "40000"], "every budget must be below --input-tokens"),
                      (["--periods", "0"], "--periods must be >= 1"), (["--lookahead", "-1"], "--lookahead must be")):
        res = run(args + ["--prompts", "1", "--temperatures", "0"], tmp_path, timeout=120)
        assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_covering_lookahead_reaches_the_next_refresh():
    """Stale by up to grid - 1 tokens at a refresh, period tokens to the next, k more in the round that crosses it:
    the smallest power of two at or past that sum."""
    assert covering_lookahead(64, 64, 11) == 256  # the paper regime: 63 + 64 + 11 = 138
    assert covering_lookahead(53, 1, 11) == 64 and covering_lookahead(54, 1, 11) == 128  # 64 exactly, then 65
    assert covering_lookahead(16, 8, 11) == 64  # the main job's grid and a short period: the layout's default
    for bad in ((0, 1, 11), (64, 0, 11), (64, 1, True)):
        with pytest.raises(ValueError, match="positive integer"):
            covering_lookahead(*bad)


def test_controllers_from_several_folders_are_named_by_folder(tmp_path):
    """One folder (or one that holds any, the others missing or empty): families by kind; several: kind@folder."""
    from rift_ada.refresh import PeriodicController, load_controllers

    for folder, period in (("controller", 16), ("controller-8k", 64)):
        (tmp_path / folder).mkdir()
        PeriodicController(period).save(tmp_path / folder / "controller-periodic.json")
    (tmp_path / "controller-8k" / "notes.json").write_text("{}")  # not a controller- file: not read
    both = load_controllers([tmp_path / "controller", tmp_path / "controller-8k"])
    assert {k: c.period for k, c in both.items()} == {"periodic@controller": 16, "periodic@controller-8k": 64}
    one = load_controllers([tmp_path / "missing", tmp_path / "controller-8k"])
    assert {k: c.period for k, c in one.items()} == {"periodic": 64}
    assert list(load_controllers([tmp_path / "controller" / "controller-periodic.json"])) == ["periodic"]
