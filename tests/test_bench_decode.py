"""experiments/bench_decode.py --compile at toy size on the shipped pair: every row the README's speed table reads is
there, every path gives the target's own greedy tokens, and the compiled paths compile in their warm-up and never
while timed."""

import json
import runpy
import sys

import pytest
import torch


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_decode_compile_writes_every_row(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--compile", "--lengths", "600", "--prompts", "1",
                                      "--max-new-tokens", "16", "--budget", "128", "--repeats", "1",
                                      "--output", str(out)])
    torch._dynamo.reset()
    with pytest.raises(SystemExit) as done:
        runpy.run_path("experiments/bench_decode.py", run_name="__main__")
    assert done.value.code == 0
    row = json.loads(out.read_text())["lengths"][0]
    assert row["input_tokens"] == 600 and row["prefill_s"] > 0
    expected = {"greedy", "greedy_compiled", "full", "full_compiled", "rift_dyn", "rift_dyn_compiled", "hf_assisted",
                "rift_dyn_static", "greedy_static"}
    assert expected <= set(row["tokens_per_s"]) and min(row["tokens_per_s"].values()) > 0
    assert min(row["draft_ms_per_step"][k] for k in ("eager", "static", "compiled")) > 0
    assert all(row["same_output"].values()), row["same_output"]
    # rift-dyn's warm-up compiles the draft step and the verify; the full cache runs the same two graphs (a cache's
    # slot axis is a size they take); nothing compiles while timed.
    assert row["warmup_graphs"]["rift_dyn"] == 2 and row["warmup_graphs"]["full"] == 0 and row["recompiles"] == 0
