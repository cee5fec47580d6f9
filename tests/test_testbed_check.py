import json
import os
import subprocess
import sys

import pytest
import torch

from rift_ada.data import build_tasks, encode
from rift_ada.models import greedy_reference
from rift_ada.testbed.check import copy_accuracy, run_check
from tests.conftest import random_model

ENV = dict(os.environ, HF_HUB_OFFLINE="1")


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "rift_ada.testbed", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_copy_accuracy_counts_positions():
    assert copy_accuracy([1, 2, 3, 4], [1, 2, 9, 4, 5], 4) == 0.75
    assert copy_accuracy([1, 2], [1, 2, 3, 4], 4) == 0.5  # stopping early counts as wrong
    assert copy_accuracy([1, 2, 3], [1, 2], 8) == 1.0  # scored over the reference that exists


def test_check_cli_json_fields(tokenizer, testbed_target, testbed_draft):
    """The CLI's JSON is run_check's result on the tasks its options name, field for field: here on the trained
    pair, whose scores are far from 0 and 1 (the shipped pair copies every token of these prompts, so scores of 1.0
    would not show a mixed-up field); run_check itself is checked against recomputed scores below."""
    out = cli("check", "--json", "--per-prompt", "--prompts", "2", "--new-tokens", "24", "--input-tokens", "1024",
              "--target", "testbed-lm", "--draft", "testbed-lm-draft", "--code-windows", "0", "--family-prompts", "0")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    tasks = build_tasks(tokenizer, "low", n=2, input_tokens=1024, seed=0)
    expected = run_check(testbed_target, testbed_draft, tokenizer, tasks, new_tokens=24, progress=False)
    costs = res.pop("costs")  # measured times: every other field is the same computation
    assert set(costs) == set(expected.pop("costs")) and all(v > 0 for v in costs.values()), costs
    assert res == expected
    assert res["prompts"] == 2 and len({res[k] for k in ("target_copy_accuracy", "draft_copy_accuracy",
                                                          "draft_agreement")}) == 3, res


def test_check_scores_the_draft_it_is_given(tokenizer, testbed_target, testbed_draft):
    """run_check's numbers, recomputed here from each model's own greedy output and logits, for the testbed draft
    and for a random draft with the same vocabulary (which must score far lower: a check that measured the target
    twice, or the wrong model, fails here)."""
    tasks = build_tasks(tokenizer, "low", n=1, input_tokens=1024, seed=3)
    prompt, ref = encode(tokenizer, tasks[0].prompt), encode(tokenizer, tasks[0].reference)
    n = 24
    noise = random_model(vocab=testbed_target.config.vocab_size, seed=0, init=0.02)
    ids = torch.tensor([prompt + ref[:n]])
    with torch.no_grad():
        target_top1 = testbed_target(ids).logits[0, len(prompt) - 1:-1].argmax(-1)
    target_acc = copy_accuracy(greedy_reference(testbed_target, prompt, n), ref, n)
    res = {}
    for name, draft in (("testbed", testbed_draft), ("random", noise)):
        res[name] = run_check(testbed_target, draft, tokenizer, tasks, new_tokens=n, progress=False)
        assert res[name]["target_copy_accuracy"] == target_acc
        assert res[name]["draft_copy_accuracy"] == copy_accuracy(greedy_reference(draft, prompt, n), ref, n)
        with torch.no_grad():
            draft_top1 = draft(ids).logits[0, len(prompt) - 1:-1].argmax(-1)
        assert res[name]["draft_agreement"] == pytest.approx((draft_top1 == target_top1).float().mean().item())
    # The testbed bar (README: agreement >= 0.85); a random draft agrees by chance only (1 / 1024 per token).
    assert res["testbed"]["draft_agreement"] >= 0.85 and res["random"]["draft_agreement"] < 0.2
    assert res["random"]["draft_copy_accuracy"] < 0.2 < target_acc


def test_check_greedy_steps_are_the_models_own(tokenizer, testbed_target):
    """decode_once's greedy tokens are greedy_reference's (transformers' own decoding), whether they run on
    rift_ada's static steps (the testbed target) or, for a model those cannot run (eager attention), on the model's
    own cache."""
    from rift_ada.static import check_static
    from rift_ada.testbed.check import decode_once

    task = build_tasks(tokenizer, "low", n=1, input_tokens=512, seed=5)[0]
    prompt, ref = encode(tokenizer, task.prompt), encode(tokenizer, task.reference)
    eager = random_model(vocab=testbed_target.config.vocab_size, seed=1)
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError):
        check_static(eager, "target")
    check_static(testbed_target, "target")
    for model in (testbed_target, eager):
        got = decode_once(model, prompt, ref, 32)
        assert got.greedy == greedy_reference(model, prompt, 32)
        assert got.prefill_s > 0 and got.step_s > 0


def test_check_cli_takes_several_lengths(tokenizer, testbed_target, testbed_draft):
    """--input-tokens 512 1024: one result per length, each run_check's on that length's prompts; the short-context
    families and code windows at the first length only."""
    out = cli("check", "--json", "--prompts", "1", "--new-tokens", "12", "--input-tokens", "512", "1024",
              "--target", "testbed-lm", "--draft", "testbed-lm-draft", "--code-windows", "1", "--family-prompts", "1")
    assert out.returncode == 0, out.stderr
    first, second = json.loads(out.stdout)["lengths"]
    assert (first["input_tokens"], second["input_tokens"]) == (512, 1024)
    assert "target_sort_accuracy" in first and "target_code_top1" in first
    assert "target_sort_accuracy" not in second and "target_code_top1" not in second
    for res in (first, second):
        tasks = build_tasks(tokenizer, "low", n=1, input_tokens=res["input_tokens"], seed=0)
        expected = run_check(testbed_target, testbed_draft, tokenizer, tasks, new_tokens=12, progress=False)
        for key in ("target_copy_accuracy", "draft_copy_accuracy", "draft_agreement", "mean_prompt_tokens"):
            assert res[key] == expected[key], key
        assert all(v > 0 for v in res["costs"].values())
    assert first["mean_prompt_tokens"] < second["mean_prompt_tokens"]


def test_check_cli_bad_input_is_one_line():
    out = cli("check", "--task", "medium", "--prompts", "1")
    assert out.returncode == 2 and "unknown task family 'medium'" in out.stderr and "Traceback" not in out.stderr
    out = cli("check", "--prompts", "1", "--input-tokens", "50000")
    assert out.returncode == 2 and "context is" in out.stderr and "Traceback" not in out.stderr
    out = cli("check", "--prompts", "1", "--target", "/nonexistent/model")
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr
