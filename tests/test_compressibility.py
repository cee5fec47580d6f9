
import pytest
import torch

from rift_ada import lora
from rift_ada.attention import use_rift_attention
from rift_ada.cache import RiftCache
from rift_ada.layout import CacheLayout
from tests.conftest import feed, layout_of, random_model
from rift_ada.trainers import compressibility as C


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", ["rift-stat", "rift-dyn"])
def test_training_masks_reproduce_the_compressed_cache(arch, policy):
    model = random_model(arch, init=0.05)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (120,), generator=g).tolist()
    cont = torch.randint(0, 128, (40,), generator=g).tolist()
    cache = RiftCache(model.config.num_hidden_layers, layout_of(policy, 40, window=12, obs_window=8))
    feed(model, cache, prompt)
    cache.compress()
    sels = [[(len(prompt), layer.imp_pos.clone())] for layer in cache.layers]
    logits = []
    for i, tok in enumerate(cont):
        if policy == "rift-dyn" and i and i % 10 == 0:
            cache.refresh()
            for s, layer in zip(sels, cache.layers):
                s.append((len(prompt) + i, layer.imp_pos.clone()))
        logits.append(feed(model, cache, [tok])[-1])
        cache.rollback(0)
    if policy == "rift-dyn":
        assert any(not torch.equal(s[0][1], s[-1][1]) for s in sels), "the refreshes changed the selection"
    ids = torch.tensor([prompt + cont])
    masks = C.build_masks(ids.shape[1], len(prompt), sels, window=12)
    with torch.no_grad():
        masked = model(ids, position_ids=torch.arange(ids.shape[1])[None], rift_masks=masks).logits[0, len(prompt):]
    torch.testing.assert_close(masked, torch.stack(logits), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_continuation_pass_equals_the_full_masked_pass(arch):
    """The trainer's pass (prompt prefilled without gradient, continuation on top) gives the full-sequence masked
    pass's logits, with an adapter that is not zero; and the dense sample's (masks None) the plain forward's."""
    peft_model = lora.attach(random_model(arch, init=0.05), rank=4)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (1, 160), generator=g)
    layout = CacheLayout("rift", budget=40, window=12, obs_window=8, store=False)
    with peft_model.disable_adapter():
        sels = C.selections(C.dense_capture(peft_model, ids), 120, 160, layout, period=10)
    masks = C.build_masks(160, 120, sels, layout.tail_keep)
    with torch.no_grad():
        full = C.masked_logits(peft_model, ids, masks, 120)
        split = C.continuation_logits(peft_model, ids, masks, 120)
        dense = C.continuation_logits(peft_model, ids, None, 120)
        plain = peft_model(ids).logits[0, 119:159]
    torch.testing.assert_close(split, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(dense, plain, atol=1e-5, rtol=0)
    assert (full - plain).abs().max() > 1e-3, "the masks changed something"


def test_acceptance_loss():
    """a = sum(min(p, q)) is the temperature-1 acceptance probability; the weights and the rejection term make a
    rejected position count more, and the rejection term rewards a draft surer of the target's token."""
    p = torch.tensor([[0.9, 0.05, 0.05]]).log()
    top = p.topk(3, -1)
    same, m = C.acceptance_loss(p.clone(), top.indices, top.values, accept_weight=4.0, tv_weight=1.0)
    assert m["accept"] == pytest.approx(1.0, abs=1e-6) and m["top1"] == 1.0 and m["kl"] == pytest.approx(0, abs=1e-6)
    assert same == pytest.approx(0, abs=1e-6)
    q = torch.tensor([[0.3, 0.6, 0.1]]).log()
    _, m = C.acceptance_loss(q, top.indices, top.values)
    assert m["accept"] == pytest.approx(0.3 + 0.05 + 0.05) and m["top1"] == 0.0
    # One right and one wrong position: weighting shifts the loss towards the wrong one.
    logits = torch.stack([p[0], q[0]])
    ids, lp = top.indices.expand(2, 3), top.values.expand(2, 3)
    kl = [C.acceptance_loss(x[None], top.indices, top.values)[1]["kl"] for x in logits]
    plain = C.acceptance_loss(logits, ids, lp)[0]
    weighted = C.acceptance_loss(logits, ids, lp, accept_weight=4.0)[0]
    assert plain == pytest.approx(sum(kl) / 2) and weighted > plain
    # Where the target is sure, a sharper draft of the same argmax is accepted more often.
    sure = torch.tensor([[1.0, 0.0, 0.0]]).clamp_min(1e-9).log()
    st = sure.topk(3, -1)
    soft, sharp = torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([[6.0, 1.0, 0.0]])
    assert C.acceptance_loss(sharp, st.indices, st.values, tv_weight=1.0)[1]["accept"] > \
        C.acceptance_loss(soft, st.indices, st.values, tv_weight=1.0)[1]["accept"]


def test_dense_selection_matches_inference_prefill_selection():
    """RIFT-stat selects from the dense prefill at inference; the trainer's frozen dense pass selects the same."""
    model = random_model("llama", init=0.05)
    use_rift_attention(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 150), generator=g)
    layout = CacheLayout("rift", budget=40, window=12, obs_window=8, store=False)
    cache = RiftCache(2, layout)  # the very object the trainer's masks are built from
    feed(model, cache, ids[0, :110].tolist())
    cache.compress()
    sels = C.selections(C.dense_capture(model, ids), 110, 150, layout)
    for layer, s in zip(cache.layers, sels):
        assert len(s) == 1 and torch.equal(layer.imp_pos, s[0][1])


def test_topk_kl_is_zero_on_itself_and_positive_otherwise():
    logits = torch.randn(5, 50)
    top = torch.log_softmax(logits, -1).topk(8, -1)
    assert C.topk_kl(logits, top.indices, top.values).abs() < 1e-6
    assert C.topk_kl(torch.randn(5, 50), top.indices, top.values) > 0.01


def test_bad_inputs(tmp_path):
    import random

    with pytest.raises(ValueError, match="budgets are fractions"):
        C.sample_layout(100, (0.0, 0.5), random.Random(0))
    with pytest.raises(ValueError, match="budgets are fractions"):
        C.sample_layout(100, (0.2, 1.5), random.Random(0))
    with pytest.raises(FileNotFoundError, match="no target outputs"):
        C.load_target_outputs(tmp_path)
    base, other = random_model("llama", seed=0), random_model("llama", seed=1)
    peft_model = lora.attach(random_model("llama", seed=0))
    lora.save(peft_model, lora.fingerprint(base), tmp_path / "adapter")
    lora.load_drafter(base, tmp_path / "adapter")  # its own base: fine
    with pytest.raises(ValueError, match="another base model"):
        lora.load_drafter(other, tmp_path / "adapter")


def synthetic_store(tmp_path, target, n=3, prompt=80, cont=24):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (prompt,), generator=g).tolist() for _ in range(n)]
    return C.load_target_outputs(C.build_target_outputs(target, prompts, cont, tmp_path / "targets", top_k=8,
                                                         progress=False), vocab_size=128)


def test_target_output_format(tmp_path):
    target = random_model("llama", seed=0)
    meta, samples = synthetic_store(tmp_path, target)
    assert meta["format"] == C.FORMAT and meta["samples"] == 3 and meta["top_k"] == 8
    s = samples[0]
    assert s["continuation_ids"].shape == (24,) and s["topk_ids"].shape == (24, 8)
    # Row i is the target's distribution over continuation token i; greedy continuations are its argmax.
    assert torch.equal(s["topk_ids"][:, 0], s["continuation_ids"])
    assert torch.all(s["topk_logprobs"][:, :-1] >= s["topk_logprobs"][:, 1:])


def test_resume_loses_no_steps(tmp_path):
    target = random_model("llama", seed=0)
    _, samples = synthetic_store(tmp_path, target)
    cfg = C.TrainConfig(steps=6, lr=5e-3, warmup=1, grad_accum=2, budgets=(0.2, 0.5), obs_window=8, period=8,
                        checkpoint_every=2, seed=3)

    def student():
        torch.manual_seed(0)
        return lora.attach(random_model("llama", seed=1), rank=4)

    straight = student()
    full = C.train(straight, samples, cfg, tmp_path / "a", progress=False)
    interrupted = student()
    first = C.train(interrupted, samples, cfg, tmp_path / "b", stop_after=3, progress=False)
    assert first["steps_done"] == 3
    resumed = student()  # a fresh process: everything comes from the checkpoint
    second = C.train(resumed, samples, cfg, tmp_path / "b", progress=False)
    assert [h["step"] for h in second["history"]] == list(range(1, 7))
    assert [h["loss"] for h in second["history"]] == pytest.approx([h["loss"] for h in full["history"]], rel=1e-5)
    from peft.utils import get_peft_model_state_dict

    a, b = get_peft_model_state_dict(straight), get_peft_model_state_dict(resumed)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    assert lora.max_lora_delta(straight) > 0, "training moved the adapter"
    # Training lowered the loss on a training sample under a fixed compressed layout (per-step losses mix dense and
    # compressed samples of different budgets, so compare like with like).
    import random

    layout = C.sample_layout(len(samples[0]["prompt_ids"]), (0.3,), random.Random(0), obs_window=8)
    with torch.no_grad():
        before = C.sample_loss(student(), samples[0], layout)[0]
        after = C.sample_loss(straight, samples[0], layout)[0]
    assert after < before


def test_checkpoints_hold_tensors_and_plain_values_only(tmp_path):
    """Resuming reads a checkpoint with weights_only=True: the trainer's own checkpoints must load that way whole."""
    target = random_model("llama", seed=0)
    _, samples = synthetic_store(tmp_path, target, n=1)
    torch.manual_seed(0)
    C.train(lora.attach(random_model("llama", seed=1), rank=2), samples,
            C.TrainConfig(steps=2, warmup=1, grad_accum=1, obs_window=8, period=8, checkpoint_every=1), tmp_path / "run",
            progress=False)
    found = C.checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in found] == ["step-1", "step-2"]
    state = C.load_checkpoint(found[-1] / "state.pt")
    assert state["step"] == 2 and [h["step"] for h in state["history"]] == [1, 2] and state["optimizer"]["state"]


def test_heldout_acceptance_is_the_evaluation_summary():
    """The table's AL is rift_ada.metrics.acceptance_length per prompt, averaged: evaluate()'s own summary."""
    from rift_ada.evaluate import evaluate
    from rift_ada.policies import make_policy
    from rift_ada.speculative import Decoding, SpeculativeDecoder
    from rift_ada.trainers import compressibility_eval as E
    from tests.conftest import cached_testbed_pair

    pair = cached_testbed_pair("self")
    held = E.HeldOut(task="low", prompts=2, input_tokens=1024, new_tokens=24, draft_length=4, period=8,
                     budgets=(0.25,), temperatures=(1.0,), seed=0)
    prompts = E.eval_prompts(pair.tokenizer, held)
    budget = E.budget_tokens(prompts, 0.25)
    model, step = drafter = E.eval_drafter(pair.draft)
    al = E.heldout_acceptance(pair, drafter, prompts, "rift-stat", budget, 1.0, held)
    policy = make_policy("rift-stat", budget=budget)
    dec = SpeculativeDecoder.for_pair(pair, policy.layout, Decoding(4, 1.0, seed=0, draft_step=step), model)
    with torch.inference_mode():
        assert al == evaluate(dec, prompts, policy.controller, 24).summary["acceptance_length"] > 1


def test_hindsight_samples_train_and_leave_other_runs_as_they_were(tmp_path):
    """--hindsight-share: a compressed sample may train under the hindsight selection (the full-cache model's top keys
    at each row, trainers.compression_gap); runs without it draw exactly the samples and masks they drew before."""
    import dataclasses

    target = random_model("llama", seed=0)
    _, samples = synthetic_store(tmp_path, target, n=2)
    cfg = C.TrainConfig(budgets=(0.2, 0.5), obs_window=8, period=8)
    both = dataclasses.replace(cfg, hindsight_share=1.0)
    draws = [(C.draw_sample(cfg, samples, i), C.draw_sample(both, samples, i)) for i in range(24)]
    for (s, layout, period), (s2, layout2, period2) in draws:
        assert s is s2 and layout == layout2
        assert period2 == (None if layout is None else C.HINDSIGHT)
    assert {p for (_, _, p), _ in draws} == {None, 8}  # the old draws: stat and dyn samples, no hindsight
    torch.manual_seed(0)
    student = lora.attach(random_model("llama", seed=1), rank=4)
    sample, layout = samples[0], next(d[0][1] for d in draws if d[0][1] is not None)
    loss, _ = C.sample_loss(student, sample, layout, C.HINDSIGHT)
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None and p.grad.abs().sum() > 0
                                        for n, p in student.named_parameters() if "lora_B" in n)
    # A hindsight budget that holds every key is the full cache: the same loss as a dense sample.
    whole = dataclasses.replace(layout, budget=len(sample["prompt_ids"]) + len(sample["continuation_ids"]))
    with torch.no_grad():
        torch.testing.assert_close(C.sample_loss(student, sample, whole, C.HINDSIGHT)[0],
                                   C.sample_loss(student, sample, None)[0], rtol=1e-5, atol=1e-6)
