import json
import os
import subprocess
import sys

import pytest

from rift_ada.evaluate import build_parser, run

ENV = dict(os.environ, HF_HUB_OFFLINE="1")


def test_evaluate_json_fields_and_greedy_match(testbed_draft):
    common = ["--budget", "256", "--prompts", "2", "--input-tokens", "1024", "--max-new-tokens", "48",
              "--target", "testbed-lm", "--drafter", "testbed-lm"]
    out = run(build_parser().parse_args(["--policy", "rift-dyn", "--period", "16", *common]))
    full = run(build_parser().parse_args(["--policy", "full", "--no-greedy-check", *common]))
    for key in ("acceptance_length", "acceptance_length_by_quarter", "refreshes", "tokens_per_second",
                "draft_active_kv_bytes", "target_greedy_match", "prompts"):
        assert key in out, key
    assert out["prompts"] == 2 and out["target_greedy_match"] == 1.0
    assert len(out["acceptance_length_by_quarter"]) == 4
    # Refreshing every 16 tokens must keep the full cache's AL on copy prompts (README: 100%); here the window
    # policy alone keeps under half of it (4.4 against 9.2).
    assert out["acceptance_length"] >= 0.9 * full["acceptance_length"], (out["acceptance_length"], full)
    assert out["refreshes"] >= 2  # at least one per prompt with a 16-token period over 48 tokens
    # budget 256 + up to k + 1 tokens in flight; layers x (K, V) x KV heads x head_dim x 4 bytes (fp32)
    cfg = testbed_draft.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert out["draft_active_kv_bytes"] <= (256 + 12) * per_token


def test_active_kv_is_flat_in_context_length():
    sizes = []
    for n in (1024, 4096):
        args = build_parser().parse_args(["--policy", "rift-stat", "--budget", "256", "--prompts", "1",
                                          "--input-tokens", str(n), "--max-new-tokens", "24", "--no-greedy-check"])
        sizes.append(run(args)["draft_active_kv_bytes"])
    assert sizes[0] == sizes[1]


def test_evaluate_bad_input_is_one_line():
    for argv, msg in [(["--policy", "lru"], "unknown policy"), (["--scorer", "h2o"], "unknown scorer"),
                      (["--policy", "window", "--budget", "3"], "attention sinks"),
                      (["--policy", "rift-stat", "--budget", "64", "--window", "100"], "sliding window"),
                      (["--draft-length", "0", "--prompts", "1"], "draft length")]:
        out = subprocess.run([sys.executable, "-m", "rift_ada.evaluate", *argv], env=ENV, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 2 and msg in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)


def test_evaluate_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "rift_ada.evaluate", "--json", "--prompts", "1", "--input-tokens",
                          "1024", "--max-new-tokens", "16", "--policy", "window", "--budget", "128"],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["policy"] == "window"


def test_precomputed_references_stand_for_the_targets_own_output():
    """evaluate(references=...) compares with the given outputs instead of decoding the target again: the target's
    own outputs match, and a reference changed in one token is caught."""
    from rift_ada.evaluate import evaluate, greedy_references
    from rift_ada.speculative import SpeculativeDecoder

    from conftest import cached_testbed_pair, policy_of, train_prompts

    pair = cached_testbed_pair("testbed")
    prompts = [list(p) for p in train_prompts(2, 1024)]
    refs = greedy_references(pair.target, prompts, 24, pair.tokenizer.eos_token_id)
    policy = policy_of("rift-dyn", 128, period=16)
    dec = SpeculativeDecoder(pair.target, pair.draft, policy.layout, eos_token_id=pair.tokenizer.eos_token_id)
    assert evaluate(dec, prompts, policy.controller, 24, greedy_check=True, references=refs).rows[1][
        "target_greedy_match"]
    wrong = [refs[0], refs[1][:-1] + [(refs[1][-1] + 1) % pair.tokenizer.vocab_size]]
    ev = evaluate(dec, prompts, policy.controller, 24, greedy_check=True, references=wrong)
    assert [r["target_greedy_match"] for r in ev.rows] == [True, False]
    with pytest.raises(ValueError, match="1 greedy references for 2 prompts"):
        evaluate(dec, prompts, None, 24, greedy_check=True, references=refs[:1])
