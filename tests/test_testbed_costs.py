"""experiments/testbed_costs.py on a short prompt: every row measured, and the figures it derives consistent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_costs_script_measures_every_row(tmp_path):
    out = tmp_path / "costs.json"
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "testbed_costs.py"), "--target", "testbed-lm",
                          "--drafter", "testbed-lm-draft", "--input-tokens", "512", "--budget", "128", "--steps", "24",
                          "--greedy-tokens", "16", "--output", str(out)],
                         env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert res == json.loads(run.stdout.strip().splitlines()[-1])
    assert res["prompt_tokens"] >= 512 and res["budget"] == 128
    for key in ("target_prefill_s", "draft_prefill_s", "target_step_ms", "draft_step_ms"):
        assert res[key] > 0, key
    rift = res["rift"]
    assert rift["draft_ms_per_step"] > 0 and rift["verify_ms"] > 0 and 1 <= rift["acceptance_length"] <= 12
    assert rift["rounds"] >= 2  # 24 tokens at k = 11 take at least two rounds
    assert res["greedy"]["tokens"] == 16 and res["greedy"]["tokens_per_s"] > 0


def test_costs_script_refuses_bad_input_in_one_line():
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "testbed_costs.py"), "--greedy-tokens", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--greedy-tokens must be >= 0" in run.stderr and "Traceback" not in run.stderr


def test_round_costs_are_measured_and_price_tables_through_gpu_check(tmp_path):
    """--round-costs: the joint cost model at the prompt's length, in the file gpu_check.py --model-from reads; a
    table priced by it decodes greedily at one plain step per token."""
    from rift_ada.policies import make_policy
    from rift_ada.replay.build import build_table
    from rift_ada.speculative import Decoding
    from tests.conftest import random_model

    out = tmp_path / "costs.json"
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "testbed_costs.py"), "--target", "testbed-lm",
                          "--drafter", "testbed-lm-draft", "--input-tokens", "512", "--budget", "128", "--steps", "4",
                          "--round-costs", "--draft-lengths", "0", "1", "4", "--draft-length", "4", "--output",
                          str(out)], env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    rift = res["costs"]["testbed"]["rift"]
    assert rift["lengths"] == [res["prompt_tokens"]] and rift["blocks"] == [1, 2, 5] and rift["budget"] == 128
    verify = rift["verify_s"][0]
    assert 0 < verify[0] and verify == sorted(verify)  # a wider verify is never modelled cheaper
    assert rift["draft_s"][0] > 0 and rift["refresh_s"][0] > 0 and res["costs"]["testbed"]["full_draft_s"][0] > 0
    target = random_model("llama", vocab=64, layers=2, hidden=32, heads=2, kv_heads=1, init=0.3)
    draft = random_model("llama", vocab=64, layers=1, hidden=32, heads=2, kv_heads=1, seed=5, init=0.3)
    tables = tmp_path / "tables"
    tables.mkdir()
    ids = torch.randint(0, 64, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    layout = make_policy("rift-dyn", 24, period=8, obs_window=8).layout
    build_table(target, draft, ids, layout, Decoding(4), 40).save(tables / "t.safetensors")
    modelled = tmp_path / "model.json"
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_check.py"), "--model-from", str(out),
                          "--tables", str(tables), "--draft-length", "4", "--output", str(modelled)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    row = json.loads(modelled.read_text())["drafts"]["testbed"][str(res["prompt_tokens"])]
    assert row["greedy"]["tokens_per_s"] == pytest.approx(1 / verify[0], rel=0.02)
    assert row["rift_dyn"]["refreshes"] > 0 and row["full"]["tokens_per_s"] > 0
