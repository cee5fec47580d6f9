"""The learned scorer (rift_ada.scorers.learned, trainers/scorer.py, experiments/train_scorer.py): its features are
what they say, it meets the scorer contract and round-trips through its file, the training script writes a file that
evaluate, the policy table, the main job's layout and rift_generate load by path, and decoding with it stays
lossless."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rift_ada.cli import policy_from_args
from rift_ada.evaluate import build_parser, run
from rift_ada.layout import CacheLayout
from rift_ada.scorers import make_scorer, window_attention
from rift_ada.scorers.learned import LearnedScorer, features, make_net, n_features, profiles
from tests.conftest import script_module

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true")


def qk(t=40, w=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, w, 8, generator=g), torch.randn(1, 2, t, 8, generator=g), torch.arange(t - w, t),
            torch.arange(t))


def test_profiles_and_features_are_what_they_say():
    q, k, qp, kp = qk()
    p = profiles(q, k, qp, kp, recent=2)
    assert p.shape == (1, 2, 3, 40)
    torch.testing.assert_close(p[:, :, 0] / 40, window_attention(q, k, qp, kp))  # SnapKV's score
    torch.testing.assert_close(p[:, :, 1] / 40, window_attention(q[:, :, -2:], k, qp[-2:], kp))
    singles = torch.stack([window_attention(q[:, :, i:i + 1], k, qp[i:i + 1], kp) for i in range(6)]).amax(0)
    torch.testing.assert_close(p[:, :, 2] / 40, singles)
    x = features(p, spans=(1, 4), ahead=(2,))
    assert x.shape == (1, 2, 40, 9) and n_features((1, 4), (2,)) == 9
    j = 10  # the mean over the 4 keys up to j, and over the 2 after it, of the first profile
    torch.testing.assert_close(x[0, :, j, 3], torch.log1p(p[0, :, 0, j - 3:j + 1].mean(-1)))
    torch.testing.assert_close(x[0, :, j, 6], torch.log1p(p[0, :, 0, j + 1:j + 3].mean(-1)))


def test_learned_scorer_contract_file_and_layout(tmp_path):
    torch.manual_seed(0)
    scorer = LearnedScorer(make_net(n_features(), 8))
    q, k, qp, kp = qk(t=300, w=32)
    s = scorer.score(q, k, qp, kp)
    assert s.shape == (1, 2, 300) and torch.isfinite(s).all()
    path = tmp_path / "s.pt"
    scorer.save(path)
    loaded = make_scorer(str(path))
    torch.testing.assert_close(loaded.score(q, k, qp, kp), s)
    layout = CacheLayout("rift", budget=64, scorer=str(path))
    assert isinstance(layout.make_scorer(), LearnedScorer)
    with pytest.raises(ValueError, match="no learned scorer file"):
        CacheLayout("rift", budget=64, scorer=str(tmp_path / "missing.pt"))
    with pytest.raises(ValueError, match="takes no options"):
        make_scorer(str(path), kernel=3)
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a learned scorer file"):
        make_scorer(str(tmp_path / "other.pt"))


@pytest.mark.slow
def test_training_script_writes_a_scorer_every_entry_point_loads(tmp_path):
    out = tmp_path / "run"
    args = ["--train-prompts", "4", "--input-tokens", "512", "--continuation-tokens", "48", "--steps", "12",
            "--eval-every", "6", "--curve-prompts", "1", "--table-prompts", "1", "--new-tokens", "24",
            "--lookaheads", "0", "64", "--temperatures", "0", "--source-dir", "stdlib",
            # The trained pair: this test is about the file and who loads it; the composed pair's copier adds only time.
            "--target", "testbed-lm", "--drafter", "testbed-lm", "--output-dir", str(out)]
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_scorer.py"), *args], env=ENV,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [r["row"] for r in results["rows"]] == [
        "rift-stat snapkv lookahead 0", "rift-stat snapkv lookahead 64", "rift-stat learned",
        "rift-dyn snapkv period 32", "rift-dyn snapkv period 64", "rift-dyn learned period 64"]
    assert [p["step"] for p in results["history"]] == [0, 6, 12]
    assert all(p["al_rift_stat"] >= 1 for p in results["history"]) and list((out / "wandb").glob("offline-run-*"))
    scorer = str(out / "scorer.pt")

    # --scorer: the table alone for a scorer trained before; no targets built, no training, the same rows.
    table_only = [a for a in args if a != str(out)][:-1] + ["--output-dir", str(tmp_path / "table"), "--scorer", scorer]
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_scorer.py"), *table_only], env=ENV,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    again = json.loads((tmp_path / "table" / "results.json").read_text())
    assert again["rows"] == results["rows"] and again["history"] == [] and again["train_seconds"] == 0
    assert not (tmp_path / "table" / "targets").exists()
    missing = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_scorer.py"), "--scorer",
                              str(out / "missing.pt"), "--output-dir", str(tmp_path / "none")], env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "is not a file" in missing.stderr and "Traceback" not in missing.stderr
    common = ["--budget", "64", "--prompts", "1", "--input-tokens", "512", "--max-new-tokens", "24", "--json"]
    for policy in (["--policy", "rift-stat"], ["--policy", "rift-dyn", "--period", "8"]):
        assert run(build_parser().parse_args([*policy, "--scorer", scorer, *common]))["target_greedy_match"] == 1.0
    table = subprocess.run([sys.executable, str(ROOT / "experiments" / "policy_table.py"), "--scorer", scorer,
                            "--budget", "64", "--prompts", "1", "--input-tokens", "512", "--max-new-tokens", "16",
                            "--target", "testbed-lm", "--drafters", "testbed-lm"], env=ENV, capture_output=True,
                           text=True, timeout=600)
    assert table.returncode == 0, table.stderr[-2000:]

    # The main job builds its layout from the same options before anything slow: the file is what it scores with.
    job = script_module("train_controller")
    args = job.parse_args(["--scorer", scorer, "--budget", "64"])
    assert isinstance(policy_from_args(args, "rift-ada", controller="never").layout.make_scorer(), LearnedScorer)
    bad = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_controller.py"), "--scorer",
                          str(out / "missing.pt"), "--output-dir", str(out / "job")], env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "no learned scorer file" in bad.stderr and "Traceback" not in bad.stderr

    from rift_ada.hf import rift_generate
    from rift_ada.models import load_pair

    pair = load_pair("testbed", "testbed")
    ids = torch.randint(5, 200, (1, 256), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    mine = pair.target.generate(ids, assistant_model=pair.draft, custom_generate=rift_generate, rift_policy="rift-dyn",
                                rift_budget=64, rift_period=8, rift_layout={"scorer": scorer}, **kw)
    assert torch.equal(mine, pair.target.generate(ids, **kw)), "greedy: the target's own output"
