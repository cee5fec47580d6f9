"""A self-drafter with a LoRA adapter (``rift_ada.lora.load_self_drafter``): the target drafts for itself with the
adapter on, on the same weights (no second copy), and verifies with it off. Greedy output stays the target's own,
token for token, on the model and the static steps, single and batched, through ``generate``; sampling follows the
target's distribution. The adapter here is random and strong: the adapted model's own greedy output differs from the
target's, so a verify that ran with the adapter on would fail these tests, and its drafts differ from the unadapted
self-drafter's, so an adapter left off would too."""

import copy

import pytest
import torch

from rift_ada import lora
from rift_ada.batch import BatchDecoder
from rift_ada.evaluate import decode
from rift_ada.hf import rift_generate
from rift_ada.models import greedy_reference
from rift_ada.policies import make_policy
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import random_model
from tests.test_sampling import check_rift_dyn_sampling, models

NEW = 48


def random_adapter(model, folder, scale: float = 0.3, seed: int = 0, modules=lora.DEFAULT_TARGET_MODULES):
    """A saved adapter for ``model`` with random (non-zero) A and B on every layer: its model differs from the base."""
    peft_model = lora.attach(copy.deepcopy(model), rank=4, alpha=8, target_modules=modules)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    lora.save(peft_model, lora.fingerprint(model), folder)
    return folder


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(target, its self-drafter, prompt, the target's greedy reference, the adapted model's own greedy output)."""
    target = random_model("llama", seed=0)
    prompt = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = greedy_reference(target, prompt, NEW)
    folder = random_adapter(target, tmp_path_factory.mktemp("adapter") / "a")
    merged_copy = lora.load_drafter(target, folder, merge=True)  # the adapted model alone, for the contrast
    adapted_greedy = greedy_reference(merged_copy, prompt, NEW)
    drafter = lora.load_self_drafter(target, folder)
    return target, drafter, prompt, reference, adapted_greedy


def policy(name):
    return make_policy(name, budget=None if name == "full" else 64, period=8 if name == "rift-dyn" else None,
                       obs_window=16)


def test_the_adapter_is_strong_and_off_at_rest(adapted):
    target, drafter, prompt, reference, adapted_greedy = adapted
    assert adapted_greedy != reference  # a verify with the adapter on could not give the reference
    assert lora.shares_weights(drafter, target) and drafter.get_base_model() is target
    assert greedy_reference(target, prompt, NEW) == reference  # loading it left the target's own forward as it was
    n_params = sum(p.numel() for p in target.parameters())  # the LoRA layers live inside the target: no copy
    assert sum(p.numel() for p in drafter.parameters()) == n_params


@pytest.mark.parametrize("step", ["model", "static"])
@pytest.mark.parametrize("name", ["full", "rift-stat", "rift-dyn"])
def test_greedy_equals_the_target_with_the_adapter_drafting(adapted, name, step):
    target, drafter, prompt, reference, _ = adapted
    pol = policy(name)
    accepted = {}
    for label, draft in (("adapter", drafter), ("plain", None)):
        dec = SpeculativeDecoder(target, draft, pol.layout, draft_length=6, draft_step=step, verify_step=step)
        res = decode(dec, prompt, NEW, pol.controller)
        assert res.tokens == reference, label
        accepted[label] = [r.accepted for r in res.rounds]
    assert accepted["adapter"] != accepted["plain"]  # the adapter drafted (it changes what is accepted)
    assert greedy_reference(target, prompt, NEW) == reference  # and is off again after decoding


def test_batch_and_generate_with_the_adapter(adapted):
    target, drafter, prompt, reference, _ = adapted
    other = prompt[::-1]
    pol = policy("rift-dyn")
    dec = BatchDecoder(target, drafter, pol.layout, draft_length=6)
    dec.reset([prompt, other], NEW)
    while not dec.done:
        dec.step([True] * len(dec.live))
    assert [r.tokens for r in dec.results] == [reference, greedy_reference(target, other, NEW)]
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          custom_generate=rift_generate, rift_draft=drafter, rift_policy="rift-stat", rift_budget=64,
                          eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == reference


@pytest.mark.slow
def test_sampling_with_the_adapter_follows_the_target(tmp_path):
    target, _, _ = models()
    drafter = lora.load_self_drafter(target, random_adapter(target, tmp_path / "a", scale=0.5))
    dec, _ = check_rift_dyn_sampling(target, drafter)
    assert dec.shared_weights


def test_an_adapter_of_another_model_is_refused(adapted, tmp_path):
    other = random_model("llama", seed=3)
    folder = random_adapter(other, tmp_path / "other")
    target = adapted[0]
    with pytest.raises(ValueError, match="trained for another base model: the embedding weights differ"):
        lora.load_self_drafter(random_model("llama", seed=0), folder)
    with pytest.raises(ValueError, match="already holds LoRA layers"):  # the fixture's target holds its adapter
        lora.load_self_drafter(target, folder)


def test_generate_loads_the_adapter_once_by_folder(tmp_path):
    target = random_model("llama", seed=0)
    prompt = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = greedy_reference(target, prompt, 24)
    folder = random_adapter(target, tmp_path / "a")
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, custom_generate=rift_generate,
              rift_policy="rift-stat", rift_budget=64, eos_token_id=None, pad_token_id=0)
    for _ in range(2):  # the second call reuses the drafter the first loaded
        assert target.generate(ids, rift_draft_adapter=str(folder), **kw)[0, len(prompt):].tolist() == reference
    assert len(lora.AdapterSwitch(target).layers) == 2 * 7  # 7 adapted linear layers x 2 layers: loaded once
    with pytest.raises(ValueError, match="already holds the adapter"):
        twin = random_model("llama", seed=0)  # the target's very weights, without the LoRA layers it now holds
        target.generate(ids, rift_draft_adapter=str(random_adapter(twin, tmp_path / "b", seed=1)), **kw)
    with pytest.raises(ValueError, match="for the target drafting for itself"):
        target.generate(ids, rift_draft_adapter=str(folder), rift_draft=random_model("llama", seed=1), **kw)
