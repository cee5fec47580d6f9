"""RIFT as a vLLM draft proposer (rift_ada.vllm_proposer): greedy output through vLLM equal to vLLM's own plain
greedy output under every RIFT policy, with requests arriving and finishing at different steps; the proposer's AL
equal to rift-ada's own decoder's on the same prompts; and its settings refused in one line.

The engine runs in a subprocess (experiments/bench_vllm.py, as users run it): vLLM starts worker processes and
reads its environment at import. Without vLLM installed the engine test skips, unless ``RIFT_REQUIRE_VLLM=1`` (CI
sets it: there the README's install includes vLLM, and a skip would hide a break)."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import cached_testbed_pair
from rift_ada.refresh import ThresholdController
from rift_ada.vllm_proposer import RiftSettings, check_settings, check_vllm_version, speculative_kwargs

ROOT = Path(__file__).resolve().parents[1]


def need_vllm():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("RIFT_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is not installed but RIFT_REQUIRE_VLLM=1: install the vllm extra (README)")
        pytest.skip("vLLM is not installed (the README's test install has it)")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_with_rift_is_lossless_under_continuous_batching(tmp_path):
    need_vllm()
    controller = tmp_path / "controller.json"
    ThresholdController([("runway", "<", 0.1), ("acc_mean", "<", 0.4)], min_gap=8).save(controller)
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_vllm.py"), "--lengths", "600", "--batch-sizes", "4",
           "--max-new-tokens", "40", "--budget", "96", "--period", "16", "--stagger", "2", "--source-dir", "pip",
           "--methods", "plain", "rift-stat", "rift-dyn", "rift-ada", "--controller", str(controller),
           "--compare-decoder", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["lengths"]
    assert len(set(row["prompt_tokens"])) > 1  # prompts of different lengths
    for method, (r,) in row["methods"].items():
        assert r["same_as_plain"] is True, f"{method}: vLLM's output changed"
        if method != "plain":
            assert r["acceptance_length"] > 1.0 and r["draft_kv_bytes"] > 0
    draft = cached_testbed_pair("testbed").draft.config
    per_token = 2 * draft.num_hidden_layers * draft.num_key_value_heads * draft.head_dim * 4
    for method in ("rift-stat", "rift-dyn", "rift-ada"):  # budget + one round in flight per live request
        assert row["methods"][method][0]["draft_kv_bytes"] <= 4 * (96 + 11 + 1) * per_token
    assert row["methods"]["rift-dyn"][0]["refreshes_per_1k"] > 0
    al, ref = row["methods"]["rift-dyn"][0]["acceptance_length"], row["decoder"]["acceptance_length"]
    assert abs(al - ref) <= 0.05 * ref, f"vLLM + RiftProposer AL {al:.3f} vs rift-ada's decoder {ref:.3f}"


def test_settings_are_checked_in_one_line(tmp_path):
    kw = speculative_kwargs(7, draft="testbed-lm-draft", policy="rift-dyn", budget=256, period=32)
    assert kw["speculative_config"]["model"] == "rift_ada.vllm_proposer.RiftProposer"
    assert kw["speculative_config"]["num_speculative_tokens"] == 7
    assert RiftSettings.from_dict(kw["additional_config"]["rift"]).budget == 256
    with pytest.raises(ValueError, match="unknown RIFT setting.*'bugdet'"):
        speculative_kwargs(draft="d", bugdet=3)
    with pytest.raises(ValueError, match="needs 'draft'"):
        RiftSettings.from_dict({"budget": 3})
    with pytest.raises(ValueError, match="unknown policy"):
        speculative_kwargs(draft="d", policy="rift-fast")
    with pytest.raises(ValueError, match="larger than the context vLLM serves"):
        check_settings(RiftSettings("d", budget=8192), 1024, 4096)
    draft = cached_testbed_pair("testbed").draft.config
    with pytest.raises(ValueError, match=r"vocabulary \(1024 tokens\) differs from the target's \(32000\)"):
        check_settings(RiftSettings("d"), 32000, 4096, draft)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kind": "threshold", "signals": ["acc_1", "novelty"], "rules": [["acc_1", "<", 0.5]],
                                 "min_gap": 8}))
    with pytest.raises(ValueError) as err:
        speculative_kwargs(draft="d", policy="rift-ada", controller=str(other))
    assert "signal" in str(err.value) and "\n" not in str(err.value)


def test_an_untested_vllm_release_warns():
    with pytest.warns(RuntimeWarning, match="tested with vLLM 0.32.0, this is 0.33.1"):
        assert not check_vllm_version("0.33.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_vllm_version("0.32.0+cpu")
