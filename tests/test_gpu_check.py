"""experiments/gpu_check.py at toy sizes on CPU (the command an H200 runs is in docs/gpu-check.md): every step
against its bound, one compiled graph per model and step kind (the same for a RIFT and a full draft cache, at every
length, and in the decoder's own rounds), one device read per round, the round costs it derives and the tokens/s they
model over replay tables; the testbed and near-tie sections; and the HF assisted-generation reference."""

import json
import runpy
import sys

import pytest
import torch
from torch._dynamo.utils import counters


def run_script(monkeypatch, *argv) -> int:
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", *argv])
    with pytest.raises(SystemExit) as done:
        runpy.run_path("experiments/gpu_check.py", run_name="__main__")
    return done.value.code


@pytest.mark.slow
def test_gpu_check_tiny_times_every_compiled_step_against_its_bound(tmp_path, monkeypatch):
    out = tmp_path / "gpu.json"
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    assert run_script(monkeypatch, "--tiny", "--sections", "steps,decode", "--output", str(out)) == 0
    report = json.loads(out.read_text())
    # The target's verify and plain step, each draft's step: one graph each, whatever the length and the draft's
    # cache (RIFT or full); the decoder's own rounds compile none more.
    assert counters["stats"]["unique_graphs"] - graphs == 4
    assert report["cudagraph_skips"] == 0 and report["steps_kind"] == "compiled"
    assert [r["input_tokens"] for r in report["steps"]] == [160, 320]
    for row in report["steps"]:
        t = row["target"]
        assert t["kv_bytes"] == row["input_tokens"] * 4 * 2 * 2 * 32 * 4  # layers, K and V, KV heads, d, float32
        for step in (t["verify"], t["plain"], row["4b"]["rift"], row["0.6b"]["rift"], row["0.6b"]["full"]):
            ms = step.get("ms", step.get("ms_per_step"))
            assert ms > 0 and step["bound_ms"] > 0 and step["ratio_to_bound"] == pytest.approx(ms / step["bound_ms"])
        # The budget caps what the RIFT step attends over; the full cache's grows with the prompt.
        assert row["4b"]["rift"]["active_tokens"] == row["0.6b"]["rift"]["active_tokens"] == 64
        assert row["0.6b"]["full"]["active_tokens"] > row["input_tokens"]
        assert row["0.6b"]["rift"]["refresh_ms"] > 0 and "full" not in row["4b"]
    costs = report["costs"]
    from rift_ada.joint.costs import RoundCosts

    rc = RoundCosts.from_dict(costs["0.6b"]["rift"])
    assert rc.lengths == (160, 320) and rc.blocks == (1, 2, 12) and rc.steps == "compiled"
    assert rc.verify(1, 160) == pytest.approx(report["steps"][0]["target"]["plain"]["ms"] / 1000)
    assert rc.verify(6, 320) == pytest.approx(report["steps"][1]["target"]["verify"]["ms"] / 1000)
    assert len(costs["0.6b"]["full_draft_s"]) == 2 and "full_draft_s" not in costs["4b"]
    d = report["decode"]
    assert d["host_reads_per_round"] == 1 and d["rounds"] >= 5 and d["draft_ms_per_step_in_loop"] > 0


@pytest.mark.slow
def test_gpu_check_tiny_testbed_and_near_tie_sections(tmp_path, monkeypatch):
    """The shipped pair on CPU in float32 (static steps, eager): rift-dyn and our plain greedy reproduce HF's greedy
    output, one device read per round; float32 leaves no tie to explain."""
    out = tmp_path / "gpu.json"
    assert run_script(monkeypatch, "--tiny", "--steps", "static", "--sections", "testbed,ties", "--testbed-new-tokens",
                      "48", "--output", str(out)) == 0
    report = json.loads(out.read_text())
    tb = report["testbed"]
    assert tb["rift_dyn"]["same_as_hf_greedy"] and tb["greedy_ours"]["same_as_hf_greedy"]
    assert tb["rift_dyn"]["host_reads_per_round"] == 1 and tb["rift_dyn"]["acceptance_length"] > 5
    assert tb["rift_dyn_vs_best_greedy"] == pytest.approx(tb["rift_dyn"]["tokens_per_s"] /
                                                          tb["greedy_ours"]["tokens_per_s"])
    assert report["ties"]["dtype"] == "float32"
    assert report["ties"]["static_greedy"]["equal"] and report["ties"]["rift_dyn_static"]["equal"]


def test_a_failed_section_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    """One device call must bring back all it can: a section that raises leaves its error in the JSON, the sections
    after it still run, and the run exits 1."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", "experiments/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def boom(args):
        raise RuntimeError("planted")

    monkeypatch.setattr(mod, "ties_section", boom)
    out = tmp_path / "gpu.json"
    assert mod.main(["--tiny", "--steps", "static", "--sections", "ties,steps", "--lengths", "160", "--drafts", "0.6b",
                     "--output", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["ties_error"] == "ties: RuntimeError: planted"
    assert report["steps"][0]["0.6b"]["rift"]["ms_per_step"] > 0 and list(report["costs"]) == ["0.6b"]


def test_modelled_tokens_per_second_price_tables_with_measured_costs(tmp_path, monkeypatch):
    """--model-from: greedy tables replayed under a cost model. Greedy decoding costs a plain step per token, so its
    modelled tokens/s is 1 / that step at the priced length; full-cache drafting and rift-dyn draft k a round; a bad
    pairing of options is refused in one line."""
    from rift_ada.joint.costs import RoundCosts
    from rift_ada.policies import make_policy
    from rift_ada.replay import ReplayTable
    from rift_ada.replay.build import build_table
    from rift_ada.speculative import Decoding
    from tests.conftest import random_model

    target = random_model("llama", vocab=64, layers=2, hidden=32, heads=2, kv_heads=1, init=0.3)
    draft = random_model("llama", vocab=64, layers=1, hidden=32, heads=2, kv_heads=1, seed=5, init=0.3)
    layout = make_policy("rift-dyn", 24, period=8, obs_window=8).layout
    tables = tmp_path / "tables"
    tables.mkdir()
    for i in range(2):
        ids = torch.randint(0, 64, (64,), generator=torch.Generator().manual_seed(i)).tolist()
        build_table(target, draft, ids, layout, Decoding(4), 40).save(tables / f"t{i}.safetensors")
    plain, verify, draft_s, refresh = (0.004, 0.006), (0.010, 0.014), (0.001, 0.0012), (0.02, 0.03)
    costs = RoundCosts((1000, 4000), (1, 2, 5), tuple((p, v, v) for p, v in zip(plain, verify)), draft_s, refresh,
                       budget=24, steps="compiled")
    measured = tmp_path / "gpu.json"
    measured.write_text(json.dumps({"costs": {"x": {"rift": costs.to_dict(), "full_draft_s": [0.003, 0.009]}}}))
    out = tmp_path / "model.json"
    assert run_script(monkeypatch, "--model-from", str(measured), "--tables", str(tables), "--draft-length", "4",
                      "--period", "8", "--output", str(out)) == 0
    x = json.loads(out.read_text())["drafts"]["x"]
    for length, p in (("1000", plain[0]), ("4000", plain[1])):
        row = x[length]
        # Each table's continuation is 40 tokens after the prefill's: 39 plain steps, priced at length + generated.
        assert row["greedy"]["tokens_per_s"] == pytest.approx(1 / p, rel=0.02)
        assert row["greedy"]["k_share"] == {"0": 1.0}
        for path in ("full", "rift_dyn"):
            assert row[path]["acceptance_length"] >= 1 and row[path]["tokens_per_s"] > 0
        assert row["rift_dyn"]["refreshes"] > 0 and row["full"]["refreshes"] == 0
    # Dearer steps at 4K: every path slower there.
    assert all(x["4000"][p]["tokens_per_s"] < x["1000"][p]["tokens_per_s"] for p in ("greedy", "full", "rift_dyn"))
    # A table derived from t0 for another cache (a paper-regime folder holds them beside the main ones) is not priced
    # as if it were this decoder's; a main table of other settings is refused in one line.
    other = ReplayTable.load(tables / "t0.safetensors")
    other.header = {**other.header, "layout": {**other.header["layout"], "kind": "window"}}
    other.save(tables / "t0.window.safetensors")
    again = tmp_path / "again.json"
    assert run_script(monkeypatch, "--model-from", str(measured), "--tables", str(tables), "--draft-length", "4",
                      "--period", "8", "--output", str(again)) == 0
    assert json.loads(again.read_text())["tables"] == 2 and json.loads(again.read_text())["drafts"]["x"] == x
    # Costs of batched rounds (bench_decode.py --batch-sizes: "batch" rows served by each round): the batch's
    # tokens/s is the modelled sequence's times its rows.
    batched = tmp_path / "batch.json"
    batched.write_text(json.dumps({"costs": {"x@batch4": {"rift": costs.to_dict(), "full_draft_s": [0.003, 0.009],
                                                          "batch": 4}}}))
    four = tmp_path / "four.json"
    assert run_script(monkeypatch, "--model-from", str(batched), "--tables", str(tables), "--draft-length", "4",
                      "--period", "8", "--output", str(four)) == 0
    y = json.loads(four.read_text())["drafts"]["x@batch4"]
    for length in ("1000", "4000"):
        for path in ("greedy", "full", "rift_dyn"):
            assert y[length][path]["tokens_per_s"] == pytest.approx(4 * x[length][path]["tokens_per_s"])
    (tables / "t0.window.safetensors").rename(tables / "t2.safetensors")
    assert run_script(monkeypatch, "--model-from", str(measured), "--tables", str(tables)) == 2
    assert run_script(monkeypatch, "--model-from", str(measured)) == 2
    assert run_script(monkeypatch, "--sections", "steps,bogus") == 2


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
