"""experiments/gpu_check.py at toy sizes on CPU (the H200 run is recorded in experiments/results/), and the HF
assisted-generation reference it and bench_decode compare against."""

import json
import runpy
import sys

import pytest


def test_gpu_check_tiny_runs_and_reports_consistent_figures(tmp_path, monkeypatch):
    out = tmp_path / "gpu.json"
    argv = ["gpu_check.py", "--tiny", "--skip-testbed", "--lengths", "200", "--budget", "96", "--period", "4", "--max-new-tokens",
            "10", "--compile", "--output", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        runpy.run_path("experiments/gpu_check.py", run_name="__main__")
    assert done.value.code == 0
    row = json.loads(out.read_text())["lengths"][0]
    full, stat, dyn = row["full"], row["rift-stat"], row["rift-dyn"]
    # The budget caps the draft's active KV: 96 tokens + the round in flight, against 200 + for the full cache.
    assert stat["draft_active_kv_bytes"] < 0.7 * full["draft_active_kv_bytes"]
    assert dyn["refreshes"] >= 1 and stat["refreshes"] == 0
    for r in (full, stat, dyn):
        assert sum(r["round_split"].values()) == pytest.approx(1.0)
        assert min(r["round_split"].values()) >= 0
    # float32 on CPU, peaked logits: every loop reproduces the target's greedy output.
    for r in (full, stat, dyn, row["rift-dyn-compiled"], row["hf_assisted"], row["hf_assisted_default"]):
        assert r["shared_prefix_with_greedy"] == 10
    # --compile: the draft step's graph and the verify's, compiled in the warm-up; none during the timed run.
    assert row["warmup_graphs"] == 2 and row["recompiles"] == 0 and row["compile_s"] > 0
    assert row["bare_draft_forward_ms"] > 0 and row["bare_verify_forward_ms"] > 0


def test_assisted_reference_applies_k_to_the_assistant_and_restores_it(testbed_target, testbed_draft, tokenizer):
    from rift_ada.data import build_tasks, encode
    from rift_ada.models import assisted_reference, greedy_reference

    ids = encode(tokenizer, build_tasks(tokenizer, "low", n=1, input_tokens=1024)[0].prompt)
    before = testbed_draft.generation_config.to_dict()
    calls = []
    hook = testbed_draft.register_forward_hook(lambda *a: calls.append(1))
    try:
        counts = {}
        for k in (1, 6):
            calls.clear()
            assert assisted_reference(testbed_target, testbed_draft, ids, 24, k) == greedy_reference(
                testbed_target, ids, 24)
            counts[k] = len(calls)
    finally:
        hook.remove()
    # k=1 drafts one token a round; k=6 drafts up to six: given on target.generate instead, both would run HF's
    # defaults and make the same calls.
    assert counts[6] > counts[1]
    assert testbed_draft.generation_config.to_dict() == before
