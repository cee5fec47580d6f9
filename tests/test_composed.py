"""The shipped testbed pair: the trained models stored, the disclosed copier composed at load, the same pair every
time (testbed/composed.py)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from rift_ada.data import build_tasks, encode
from rift_ada.models import greedy_reference, load_model, load_tokenizer, resolve
from rift_ada.testbed.composed import (ASSETS, CIRCUITS, LM_FOLDERS, cache_root, compose_role, composed_folder,
                                       read_settings, weights_moments, weights_sha256)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_same_pair_at_every_load(role):
    """A fresh composition and the cached folder that `testbed` loads are one set of weights, bit for bit; and they
    are the pair pinned when it was built: the same checksum on a CPU of the kind that pinned it, else the same
    per-tensor moments to rounding (another CPU's SIMD kernels round the calibration forward and the kernel fits
    differently; a change to the circuit or the trained weights moves the moments by far more than 1e-5)."""
    model = compose_role(role)
    fresh = weights_sha256(model)
    name = {"target": "testbed", "draft": "testbed-draft"}[role]
    assert weights_sha256(load_model(name)) == fresh, "the cached folder is the fresh composition"
    settings = read_settings()
    if fresh == settings["composed_sha256"][role]:
        return
    pinned = settings["composed_moments"][role]
    ours = weights_moments(model)
    assert ours.keys() == pinned.keys()
    for tensor, (s, a, q) in pinned.items():
        s2, a2, q2 = ours[tensor]
        assert abs(s2 - s) <= 1e-5 * a + 1e-9 and abs(a2 - a) <= 1e-5 * a + 1e-9 and abs(q2 - q) <= 1e-5 * q + 1e-9, (
            f"composed {role} {tensor}: moments {ours[tensor]} != pinned {pinned[tensor]} (rebuild: pin_checksums())")


def test_names_give_the_composed_and_the_trained_pairs():
    lm = {role: json.loads((ASSETS / folder / "config.json").read_text()) for role, folder in LM_FOLDERS.items()}
    for name, role, composed in (("testbed", "target", True), ("testbed-target", "target", True),
                                 ("testbed-draft", "draft", True), ("testbed-lm", "target", False),
                                 ("testbed-lm-target", "target", False), ("testbed-lm-draft", "draft", False)):
        folder = Path(resolve(name))
        cfg = json.loads((folder / "config.json").read_text())
        if composed:
            assert folder.parent == cache_root() and folder == composed_folder(role)
            # The trained model's residual and heads, widened for the copier beside them.
            assert cfg["hidden_size"] > lm[role]["hidden_size"] and cfg["head_dim"] == 2 * lm[role]["head_dim"] + \
                CIRCUITS[role].extra_head_dims
            assert cfg["rope_parameters"]["rope_type"] == "longrope"
        else:
            assert folder == ASSETS / LM_FOLDERS[role] and cfg == lm[role]
        assert (folder / "tokenizer.json").read_bytes() == (ASSETS / "lm-target" / "tokenizer.json").read_bytes()


def test_no_composed_weights_in_the_repository():
    """The stored testbed (trained weights, settings, tokenizer) stays under 25 MB; nothing composed is tracked."""
    tracked = subprocess.run(["git", "ls-files", "testbed/assets"], cwd=ROOT, capture_output=True,
                             text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    files = [ROOT / f for f in tracked.stdout.split()]
    assert sum(f.stat().st_size for f in files if f.exists()) <= 25 * 2 ** 20
    assert {f.parent.name for f in files if f.name == "model.safetensors"} == set(LM_FOLDERS.values())


@pytest.mark.slow
def test_saved_and_reloaded_composite_decodes_the_same_tokens(tmp_path):
    """The composed target is an ordinary LlamaForCausalLM: save_pretrained then from_pretrained decodes alike."""
    from transformers import LlamaForCausalLM

    tok = load_tokenizer("testbed")
    model = load_model("testbed")
    assert type(model) is LlamaForCausalLM
    model.save_pretrained(tmp_path / "copy")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "copy").eval()
    task = build_tasks(tok, "low", n=1, input_tokens=1024, seed=2)[0]
    prompt = encode(tok, task.prompt)
    out = greedy_reference(model, prompt, 32)
    assert greedy_reference(again, prompt, 32) == out
    # And it copies: the shipped pair's point (the trained model alone derails on most copies).
    ref = encode(tok, task.reference)
    assert sum(a == b for a, b in zip(out, ref)) >= 28


def test_composition_is_cached_and_shared(tmp_path, monkeypatch):
    """A second request for the pair reuses the folder; another cache root composes its own."""
    first = composed_folder("draft")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert composed_folder("draft") == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.setenv("RIFT_ADA_CACHE", str(tmp_path))
    other = composed_folder("draft")
    assert other.parent == tmp_path and other.name == first.name
    a, b = load_model(str(first)), load_model(str(other))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
