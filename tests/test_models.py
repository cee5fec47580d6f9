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
