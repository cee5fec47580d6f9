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


def test_plain_decode_from_a_kept_prefill_is_a_fresh_decode(testbed_target):
    """bench.plain_decode(prefilled=target_prefill(...)): the same tokens as prefilling afresh, greedy and sampled,
    and the kept prefill is copied, never decoded on (a second decode from it gives the same tokens again)."""
    from rift_ada.studies.decode_bench import plain_decode, target_prefill

    ids = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    kept = target_prefill(testbed_target, ids)
    before = kept[0].get_seq_length()
    for temperature in (0.0, 1.0):
        fresh, _ = plain_decode(testbed_target, ids, 24, None, temperature, seed=3)
        for _ in range(2):
            assert plain_decode(testbed_target, ids, 24, None, temperature, seed=3, prefilled=kept)[0] == fresh
    assert kept[0].get_seq_length() == before == len(ids)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_batches_writes_every_row_and_the_round_costs(tmp_path, monkeypatch):
    """--batch-sizes at toy size: a row per batch size and the mixed batch, every speculative row plain greedy's
    tokens, the draft's KV under rift-dyn rows x budget-sized (the full cache's grows with the prompt), and each
    batch size's round costs in the form gpu_check.py --model-from reads (tested there: tests/test_gpu_check.py)."""
    from rift_ada.joint.costs import RoundCosts

    out = tmp_path / "batch.json"
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--batch-sizes", "1", "2", "--lengths", "600",
                                      "--max-new-tokens", "16", "--budget", "128", "--mixed-batch", "3",
                                      "--output", str(out)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path("experiments/bench_decode.py", run_name="__main__")
    assert done.value.code == 0
    report = json.loads(out.read_text())
    rows = report["lengths"][0]["batches"]
    assert [r["batch"] for r in rows] == ["low x1", "low x2", "mixed x3"]
    for r in rows:
        assert all(r["same_output"].values()) and set(r["tokens_per_s"]) == {"greedy", "full", "rift_dyn"}
        assert set(r["split"]["rift_dyn"]) >= {"refresh", "draft", "verify", "rollback", "host"}
        assert r["draft_active_kv_bytes"]["rift_dyn"] < r["draft_active_kv_bytes"]["full"]
    one, two = (rows[i]["draft_active_kv_bytes"]["rift_dyn"] for i in (0, 1))
    assert one < two <= 2 * one  # rows x (budget + the round in flight) x bytes per token, at the largest round
    costs = report["costs"]
    assert set(costs) == {"testbed@batch1", "testbed@batch2"} and costs["testbed@batch2"]["batch"] == 2
    c = RoundCosts.from_dict(costs["testbed@batch2"]["rift"])
    assert c.lengths == (600,) and c.blocks == (1, 12) and c.budget == 128 and c.steps == "static"


@pytest.mark.slow
def test_bench_batches_runs_only_the_decoders_asked_for(tmp_path, monkeypatch):
    """--batch-runs rift_dyn (the long-context memory row, where every decoder costs a target prefill per row): no
    greedy or full run, so no speed ratio, no output check (None, not a pass) and no GPU costs; the bytes are there."""
    out = tmp_path / "batch.json"
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--batch-sizes", "2", "--lengths", "600", "--max-new-tokens",
                                      "8", "--budget", "128", "--mixed-batch", "0", "--batch-runs", "rift_dyn",
                                      "--output", str(out)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path("experiments/bench_decode.py", run_name="__main__")
    assert done.value.code == 0
    report = json.loads(out.read_text())
    (row,) = report["lengths"][0]["batches"]
    assert set(row["tokens_per_s"]) == {"rift_dyn"} and row["same_output"] == {"rift_dyn": None}
    assert "speedup_vs_greedy" not in row and report["costs"] == {}
    assert 2 * 128 * 24_576 <= row["draft_active_kv_bytes"]["rift_dyn"] <= 2 * (128 + 12) * 24_576
