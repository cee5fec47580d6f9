import json
import os
import subprocess
import sys
from pathlib import Path

from rift_ada.evaluate import build_parser, run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "train_compressibility.py"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true")
SMALL = ["--target", "testbed-lm", "--drafter", "testbed-lm", "--train-prompts", "2", "--steps", "3", "--grad-accum", "1", "--input-tokens", "1024",
         "--continuation-tokens", "16", "--eval-prompts", "1", "--eval-new-tokens", "16", "--eval-budgets", "0.25",
         "--temperatures", "0", "--checkpoint-every", "1"]


def script(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_small_run_then_adapter_in_evaluate(tmp_path):
    out = tmp_path / "run"
    res = script(*SMALL, "--output-dir", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| AL untrained | AL trained | change [95% over prompts] |" in res.stdout
    results = json.loads((out / "results.json").read_text())
    assert {(r["policy"], r["budget_fraction"]) for r in results["rows"]} == {
        ("full", None), ("rift-stat", 0.25), ("rift-dyn", 0.25)}
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "targets" / "meta.json").is_file()
    assert list((out / "wandb").glob("offline-run-*"))
    for merge in ([], ["--lora-merge"]):
        args = build_parser().parse_args(["--target", "testbed-lm", "--drafter", "testbed-lm", "--lora", str(out / "adapter"), "--prompts", "1",
                                          "--input-tokens", "1024", "--max-new-tokens", "24", *merge])
        assert run(args)["target_greedy_match"] == 1.0
    # The stored target outputs are reused, and a finished run resumes to nothing new.
    again = script(*SMALL, "--output-dir", str(out))
    assert again.returncode == 0 and "target outputs" not in again.stderr


def test_training_task_families(tokenizer):
    from rift_ada.trainers.compressibility import TRAIN_FAMILIES, training_tasks

    mixed = training_tasks(tokenizer, 8, 1024, seed=0)
    assert [t.family for t in mixed] == list(TRAIN_FAMILIES) * 2  # interleaved: any prefix holds every family
    low = training_tasks(tokenizer, 3, 1024, seed=0, families=("low",))
    assert [t.family for t in low] == ["low"] * 3
    assert low[0].prompt == mixed[0].prompt  # a family's prompts do not depend on which others are drawn


def test_bad_input_is_clear(tmp_path):
    res = script("--budgets", "0", "0.5", "--output-dir", str(tmp_path))
    assert res.returncode == 2 and "--budgets are fractions" in res.stderr and "Traceback" not in res.stderr
    res = script("--eval-budgets", "1.5", "--output-dir", str(tmp_path))
    assert res.returncode == 2 and "--eval-budgets are fractions" in res.stderr
    res = script("--train-tasks", "medium", "--output-dir", str(tmp_path))
    assert res.returncode == 2 and "invalid choice: 'medium'" in res.stderr
    res = script("--dense-share", "1.5", "--output-dir", str(tmp_path))
    assert res.returncode == 2 and "--dense-share is a share" in res.stderr
    res = script("--lora-layers", "7", "--steps", "1", "--train-prompts", "1", "--input-tokens", "1024",
                 "--continuation-tokens", "4", "--target", "testbed-lm", "--drafter", "testbed-lm",
                 "--output-dir", str(tmp_path / "layers"))
    assert res.returncode == 2 and "LoRA layers [7]" in res.stderr and "Traceback" not in res.stderr
    res = script("--targets", str(tmp_path / "missing"), "--output-dir", str(tmp_path))
    assert res.returncode == 2 and "no target outputs" in res.stderr and "Traceback" not in res.stderr


def test_self_drafter_run_keeps_one_copy_and_decodes_losslessly(tmp_path):
    """--self: the adapter trains in the target's own weights (the untrained row and the verifier are the target
    with it off), and the saved adapter drafts for the target in evaluate, greedy output the target's own."""
    out = tmp_path / "self"
    assert SMALL[:4] == ["--target", "testbed-lm", "--drafter", "testbed-lm"]
    args = ["--target", "testbed-lm", "--self", *SMALL[4:], "--lora-layers", "all", "--lr", "5e-3"]
    res = script(*args, "--output-dir", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    full = [r for r in results["rows"] if r["policy"] == "full"]
    # The untrained self-drafter with a full cache is the target itself: every draft accepted (greedy, k = 11): the
    # 15 tokens after the prefill's first in two rounds (12 + 3). A verify with the adapter on would not be lossless.
    assert [r["al_untrained"] for r in full] == [7.5] and results["curve"]["points"][0]["al_full"] == 7.5
    assert all(len(r["al_trained_prompts"]) == 1 and r["change_low"] <= r["change_high"] for r in results["rows"])
    ev = build_parser().parse_args(["--target", "testbed-lm", "--drafter", "self", "--draft-adapter",
                                    str(out / "adapter"), "--prompts", "1", "--input-tokens", "1024",
                                    "--max-new-tokens", "24", "--policy", "rift-stat", "--budget", "256"])
    assert run(ev)["target_greedy_match"] == 1.0
    ev.lora_merge = True
    try:
        run(ev)
        raise AssertionError("--lora-merge with --drafter self was accepted")
    except ValueError as e:
        assert "--lora-merge would fold the adapter into the target itself" in str(e)


def test_budget_and_self_options_are_checked_in_one_line():
    """What the script refuses (exit 2, through argparse's error: the subprocess cases above show the path)."""
    import argparse

    from rift_ada.trainers.compressibility import option_problem

    ok = dict(budgets=[0.125], eval_budgets=[0.25], input_tokens=2048, dense_share=0.25, dyn_share=0.25,
              hindsight_share=0.0, accept_weight=4.0, tv_weight=1.0, target="testbed-lm", drafter="testbed")
    def check(**kw):
        args = argparse.Namespace()
        for key, value in {**ok, **kw}.items():  # setattr: "self" cannot be a keyword of Namespace()
            setattr(args, key, value)
        return option_problem(args, "testbed")

    assert check() is None and check(self=True) is None and check(self=True, drafter="self") is None
    assert check(budgets=[0.0001]) == ("--budgets 0.0001 keeps 0 of the 2048-token prompts' tokens: a RIFT cache "
                                       "holds at least 2 (one selected, one in the window)")
    assert check(self=True, drafter="testbed-lm") == ("--self trains the target as its own drafter; --drafter "
                                                      "testbed-lm names another model")  # testbed-lm-draft
    assert check(hindsight_share=1.5) == "--hindsight-share is a share in [0, 1]"
