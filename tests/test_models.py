import os
import subprocess
import sys

import pytest
import torch

from rift_ada.models import ModelLoadError, check_vocab, load_model, load_pair, resolve


def test_testbed_loads_offline_through_from_pretrained():
    # A fresh interpreter with the hub switched off and a hub endpoint that cannot resolve: any network access fails.
    code = ("from rift_ada.models import load_model, load_tokenizer\n"
            "t = load_model('testbed'); d = load_model('testbed-draft'); tok = load_tokenizer('testbed')\n"
            "import transformers; assert isinstance(t, transformers.PreTrainedModel)\n"
            "print(type(t).__name__, t.config.num_key_value_heads < t.config.num_attention_heads, len(tok))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    name, gqa, vocab = out.stdout.split()
    assert name.endswith("ForCausalLM") and gqa == "True" and int(vocab) > 256


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        load_model(str(tmp_path / "empty"))


def test_vocab_mismatch_is_refused(testbed_target):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=testbed_target.config.vocab_size + 7, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="vocabulary"):
        check_vocab(testbed_target, other)


def test_pair_self_and_external():
    pair = load_pair("testbed", "self")
    assert pair.self_speculative and pair.draft is pair.target
    pair = load_pair("testbed", "testbed")
    assert not pair.self_speculative
    n_t = sum(p.numel() for p in pair.target.parameters())
    n_d = sum(p.numel() for p in pair.draft.parameters())
    assert n_d < n_t, "the draft is the smaller model"
    assert min(m.config.max_position_embeddings for m in (pair.target, pair.draft)) >= 4096 + 256
    assert all(p.dtype == torch.float32 for p in pair.target.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only placement")
def test_device_map_auto_on_cpu_decodes_losslessly(testbed_target, testbed_draft, tokenizer):
    """``device_map="auto"`` (accelerate) on a machine without GPUs puts every weight on the CPU, and speculative
    decoding on the pair gives the very tokens of the pair loaded without it (and the target's own greedy output)."""
    from rift_ada.cli import ArgumentParser, add_model_options
    from rift_ada.data import build_tasks, encode
    from rift_ada.evaluate import decode
    from rift_ada.models import greedy_reference
    from rift_ada.policies import make_policy
    from rift_ada.speculative import SpeculativeDecoder

    pair = load_pair("testbed-lm", "testbed-lm", device_map="auto")
    for model, plain in ((pair.target, testbed_target), (pair.draft, testbed_draft)):
        assert {p.device.type for p in model.parameters()} == {"cpu"} and model.device.type == "cpu"
        assert model.dtype == torch.float32  # the CPU default, as without a device map
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    ids = encode(tokenizer, build_tasks(tokenizer, "low", n=1, input_tokens=1024)[0].prompt)
    pol = make_policy("rift-dyn", budget=128, period=16)
    out = [decode(SpeculativeDecoder(t, d, pol.layout, 6, eos_token_id=tokenizer.eos_token_id), ids, 48,
                  pol.controller).tokens
           for t, d in ((pair.target, pair.draft), (testbed_target, testbed_draft))]
    assert out[0] == out[1] == greedy_reference(testbed_target, ids, 48, tokenizer.eos_token_id)
    p = ArgumentParser()
    add_model_options(p, device_map=True)
    assert p.parse_args(["--device-map", "auto"]).device_map == "auto" and p.parse_args([]).device_map is None
    with pytest.raises(SystemExit):
        p.parse_args(["--device-map", "everywhere"])


def test_device_map_is_refused_under_torchrun_with_several_processes(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="under torchrun each process takes one GPU"):
        load_pair("testbed", "testbed", device_map="auto")
    with pytest.raises(ValueError, match="use one of auto"):
        load_model("testbed", device_map="everywhere")


def test_model_names_come_from_registered_entry_points(monkeypatch, tmp_path):
    """The core knows no model name: the testbed's come from the ``rift_ada.models`` entry points (pyproject.toml),
    its package is imported only when one of them is resolved, and an unknown short name is a one-line error."""
    import functools
    from importlib.metadata import EntryPoint

    from rift_ada import models

    names = {"testbed", "testbed-target", "testbed-draft", "testbed-lm", "testbed-lm-target", "testbed-lm-draft"}
    assert names <= set(models.model_sources())
    assert [models.drafter_model(n) for n in ("testbed", "testbed-lm", "testbed-draft", "Qwen/Qwen3-8B")] == [
        "testbed-draft", "testbed-lm-draft", "testbed-draft", "Qwen/Qwen3-8B"]
    with pytest.raises(ModelLoadError, match="unknown model name 'testbd'") as err:
        resolve("testbd")
    assert "\n" not in str(err.value) and "testbed-lm-draft" in str(err.value)
    assert resolve("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # a hub id goes on to from_pretrained
    monkeypatch.setitem(models.MODEL_SOURCES, "mine", lambda name: tmp_path / name)
    assert resolve("mine") == str(tmp_path / "mine")
    stale = EntryPoint(name="stale", value="rift_ada.no_such_module:folder", group=models.MODEL_GROUP)
    monkeypatch.setitem(models.MODEL_SOURCES, "stale", functools.partial(models._load_entry_point, stale))
    with pytest.raises(ModelLoadError, match="does not import .* reinstall rift-ada"):
        resolve("stale")
    code = ("import sys\nfrom rift_ada.models import model_sources, resolve\nmodel_sources()\n"
            "before = 'rift_ada.testbed' in sys.modules\nresolve('testbed-lm')\n"
            "print(before, 'rift_ada.testbed.names' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["False", "True"], out.stderr
