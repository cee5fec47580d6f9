"""rift-ada inside ``model.generate``: ``custom_generate=rift_generate`` (and the repository's ``custom_generate/``
folder) decode with rift-ada's own round and honour what users pass to ``generate``.

Greedy output equals plain ``generate``'s for every policy (an exported controller file included), with the trained
testbed pair, self-speculation, and sliding-window and hybrid tiny models; sampling with a seed gives our own loop's
tokens, and its sequences follow the target's sampling distribution (top-k included); streamers, EOS, stopping
criteria and ``max_new_tokens`` behave as in plain ``generate``; what a speculative round cannot honour is refused in
one line naming the argument."""

import collections
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from rift_ada import signals
from rift_ada.architectures import family
from rift_ada.evaluate import decode
from rift_ada.hf import rift_generate
from rift_ada.policies import make_policy
from rift_ada.controllers import TreeController
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import LM_DRAFT, cached_testbed_pair, train_prompts
from tests.test_sampling import ALPHA, NEW_TOKENS, VOCAB, chi_square, models, sequence_distribution

ROOT = Path(__file__).resolve().parents[1]
NEW, BUDGET, PERIOD = 48, 96, 16


def plain(model, ids, new=NEW, **kw):
    # An explicit mask: random prompts contain the pad id, which generate would otherwise take for padding.
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kw)


def ours(model, ids, new=NEW, **kw):
    return plain(model, ids, new, custom_generate=rift_generate, **kw)


NO_EOS = dict(eos_token_id=None, pad_token_id=0)  # random models emit their EOS id early: decode every token


def rift_kw(name, controller=None):
    return dict(rift_policy=name, rift_budget=BUDGET, rift_period=PERIOD if name == "rift-dyn" else None,
                rift_controller=controller)


def exported_tree(path: Path) -> str:
    """A depth-1 tree exported as JSON: refresh once 16 tokens were generated since the last scoring."""
    since = signals.NAMES.index("since_refresh")
    TreeController(feature=(since, -1, -1), threshold=(16 / signals.SINCE_SCALE, -1.0, -1.0), left=(1, -1, -1),
                   right=(2, -1, -1), value=(0.5, 0.0, 1.0), decision=0.5).save(path)
    return str(path)


@pytest.fixture(scope="module")
def lm_pair():
    pair = cached_testbed_pair(LM_DRAFT)
    ids = torch.tensor([list(train_prompts(1, 512)[0])])
    return pair, ids


@pytest.mark.parametrize("name", ["full", "rift-stat", "rift-dyn", "rift-ada"])
def test_greedy_equals_plain_generate_on_the_testbed_pair(lm_pair, name, tmp_path):
    (pair, ids), t = lm_pair, lm_pair[0].target
    controller = exported_tree(tmp_path / "tree.json") if name == "rift-ada" else None
    ref = plain(t, ids)
    for draft in (pair.draft, None):  # the external draft, then self-speculation
        out = ours(t, ids, assistant_model=draft, return_dict_in_generate=True, rift_rounds=True,
                   **rift_kw(name, controller))
        assert torch.equal(out.sequences, ref), (name, draft is None)
        if name in ("rift-dyn", "rift-ada"):
            assert sum(r.refreshed for r in out.rounds) >= 2, "the controller refreshed the draft's cache"


def test_static_steps_through_generate(lm_pair, monkeypatch):
    """rift_draft_step / rift_verify_step reach the decoder: rift-dyn with the static draft step and verify gives
    plain generate's tokens, and the round ran on them (the static verify's cache is rift_ada.static.StaticKV)."""
    from rift_ada.static import StaticKV

    (pair, ids), t = lm_pair, lm_pair[0].target
    seen, init = [], StaticKV.__init__
    monkeypatch.setattr(StaticKV, "__init__", lambda self, *a: (seen.append(self), init(self, *a))[1])
    out = ours(t, ids, assistant_model=pair.draft, rift_draft_step="static", rift_verify_step="static",
               **rift_kw("rift-dyn"))
    assert torch.equal(out, plain(t, ids)) and len(seen) == 1


def test_assistant_model_and_streamer_reach_the_loop():
    """transformers hands a callable custom_generate neither `assistant_model` nor `streamer` (rift_ada.hf reads them
    from generate's frame): with a draft of another family acceptance drops below self-speculation's (which accepts
    every draft on a full cache), and the streamer gets the tokens."""
    target, draft = family("llama").model(seed=0), family("qwen3").model(seed=1, layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    rounds = {}
    for who, d in (("self", None), ("external", draft)):
        streamer = Recorder()
        out = ours(target, ids, assistant_model=d, streamer=streamer, return_dict_in_generate=True, rift_rounds=True,
                   rift_policy="full", **NO_EOS)
        assert out.sequences.shape[1] == 40 + NEW
        rounds[who] = out.rounds
        assert streamer.values == ids[0].tolist() + out.sequences[0, 40:].tolist()
    assert all(r.accepted == r.draft_length for r in rounds["self"])
    assert sum(r.accepted for r in rounds["external"]) < 0.8 * sum(r.draft_length for r in rounds["external"])


@pytest.mark.parametrize("key", ["mistral-swa", "gemma3", "qwen3_5", "nemotron_h"])
def test_greedy_equals_plain_generate_on_sliding_and_hybrid_models(key):
    """Prompts (80 tokens) longer than the sliding window (16) and the budget (24). transformers' generate refuses
    ``assistant_model`` for a stateful (hybrid) target before any decoding method runs: there the draft is given as
    ``rift_draft``."""
    target = family(key).model(seed=0, window=16)
    draft = family("llama").model(seed=1, layers=2)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))
    ref = plain(target, ids, new=32, **NO_EOS)
    assert ref.shape[1] == 80 + 32
    stateful = target._is_stateful
    if stateful:
        with pytest.raises(ValueError, match="stateful"):
            ours(target, ids, new=4, assistant_model=draft)
    for d in (draft, None):
        for name in ("rift-stat", "rift-dyn"):
            kw = dict(rift_policy=name, rift_budget=24, rift_period=8 if name == "rift-dyn" else None,
                      rift_layout={"obs_window": 8}, **{"rift_draft" if stateful else "assistant_model": d}, **NO_EOS)
            assert torch.equal(ours(target, ids, new=32, **kw), ref), (key, name, d is None)


def test_seeded_sampling_gives_our_loops_tokens(lm_pair):
    (pair, ids), t = lm_pair, lm_pair[0].target
    pol = make_policy("rift-dyn", BUDGET, period=PERIOD)
    dec = SpeculativeDecoder(t, pair.draft, pol.layout, 11, temperature=0.8, top_p=0.9, top_k=20, seed=5)
    mine = decode(dec, ids[0].tolist(), NEW, pol.controller).tokens
    kw = dict(assistant_model=pair.draft, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_p=0.9, top_k=20,
              custom_generate=rift_generate, **rift_kw("rift-dyn"))
    assert t.generate(ids, rift_seed=5, **kw)[0, ids.shape[1]:].tolist() == mine
    torch.manual_seed(3)
    a = t.generate(ids, **kw)
    torch.manual_seed(3)
    assert torch.equal(t.generate(ids, **kw), a), "torch.manual_seed before generate fixes the sampled tokens"


@pytest.mark.slow
def test_sampled_sequences_through_generate_follow_the_target():
    """tests/test_sampling.py's check through generate: rift-dyn (budget 12 of 24 tokens, refreshed every round),
    k = 2, temperature 1 and top-k 4 of the 6 tokens (so top-k's cut matters); chi-square at alpha 1e-3 over the
    1,296 four-token continuations, 2,000 samples."""
    target, draft, prompt = models()
    topk = 4
    dist, _ = sequence_distribution(target, prompt, NEW_TOKENS, 1.0, 1.0, top_k=topk)
    ids = torch.tensor([prompt])
    counts = collections.Counter()
    for seed in range(2000):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                              max_new_tokens=NEW_TOKENS, do_sample=True, top_k=topk, custom_generate=rift_generate,
                              rift_policy="rift-dyn", rift_budget=12, rift_period=1, rift_draft_length=2,
                              rift_layout={"obs_window": 8}, rift_seed=seed, eos_token_id=VOCAB + 1, pad_token_id=0)
        counts[tuple(out[0, len(prompt):].tolist())] += 1
    assert not {s for s in counts if dist.get(s, 0.0) == 0.0}, "a token outside the top 4 was sampled"
    stat, dof = chi_square(counts, dist, 2000)
    assert stat < chi2.ppf(1 - ALPHA, dof), (stat, dof)


class Recorder(BaseStreamer):
    def __init__(self):
        self.values, self.ended, self.puts = [], False, 0

    def put(self, value):
        self.values += value.reshape(-1).tolist()
        self.puts += 1

    def end(self):
        self.ended = True


class StopAfter(StoppingCriteria):
    """Stops once ``token`` was generated ``times`` times (a criterion that can fire inside a round)."""

    def __init__(self, token, times, prompt_len):
        self.token, self.times, self.prompt_len = token, times, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        hits = int((input_ids[0, self.prompt_len:] == self.token).sum())
        return torch.full((input_ids.shape[0],), hits >= self.times, dtype=torch.bool)


def test_streamer_eos_stopping_criteria_and_max_new_tokens_match_plain_generate(lm_pair):
    (pair, ids), t = lm_pair, lm_pair[0].target
    n = ids.shape[1]
    ref = plain(t, ids, new=64)[0, n:].tolist()
    eos = ref[20]  # a token of the greedy output: plain generate stops at its first occurrence
    kw = dict(assistant_model=pair.draft, **rift_kw("rift-dyn"))
    cases = {"eos": dict(eos_token_id=eos), "two eos ids": dict(eos_token_id=[t.config.vocab_size - 1, eos]),
             "criterion": dict(stopping_criteria=StoppingCriteriaList([StopAfter(ref[30], 1, n)])),
             "max_new_tokens": dict(eos_token_id=None)}
    for case, extra in cases.items():
        for new in (64, 7):
            theirs = plain(t, ids, new=new, **extra)
            if new == 64:
                assert (theirs.shape[1] - n < 64) == (case != "max_new_tokens"), "the stop is exercised"
            streamer = Recorder()
            mine = ours(t, ids, new=new, streamer=streamer, **kw, **extra)
            assert torch.equal(mine, theirs), (case, new)
            assert streamer.values == mine[0].tolist() and streamer.ended, "the prompt, then each generated token"
            assert streamer.puts == 1 + mine.shape[1] - n, "one put per token, as plain generate"


def test_the_custom_generate_folder_loads_by_path(lm_pair, tmp_path):
    (pair, ids), t = lm_pair, lm_pair[0].target
    controller = exported_tree(tmp_path / "tree.json")
    out = t.generate(ids, assistant_model=pair.draft, max_new_tokens=NEW, do_sample=False, custom_generate=str(ROOT),
                     trust_remote_code=True, **rift_kw("rift-ada", controller))
    assert torch.equal(out, plain(t, ids))
    with pytest.raises(ValueError, match="trust_remote_code"):
        t.generate(ids, max_new_tokens=4, custom_generate=str(ROOT))


@pytest.mark.parametrize("name,step", [("rift-dyn", "model"), ("rift-ada", "model"), ("rift-dyn", "static")])
def test_a_left_padded_batch_gives_each_rows_own_greedy_output(lm_pair, name, step, tmp_path):
    """A batch of three prompts of different lengths, left-padded with their attention mask, through generate:
    each row's tokens are that prompt's own greedy output (plain generate, unpadded); rows that end early are padded
    on the right with pad_token_id, as plain generate pads them."""
    (pair, ids), t = lm_pair, lm_pair[0].target
    controller = exported_tree(tmp_path / "tree.json") if name == "rift-ada" else None
    rows = [ids[0, :512], ids[0, 100:400], ids[0, 200:]]
    width = max(len(r) for r in rows)
    batch = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, width - len(r):], mask[i, width - len(r):] = r, 1
    out = t.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False, assistant_model=pair.draft,
                     custom_generate=rift_generate, rift_draft_step=step, rift_verify_step=step,
                     **rift_kw(name, controller))
    for i, r in enumerate(rows):
        ref = plain(t, r[None])[0, len(r):]
        assert torch.equal(out[i, :width], batch[i])
        got = out[i, width:]
        assert torch.equal(got[:len(ref)], ref) and bool((got[len(ref):] == t.generation_config.pad_token_id).all())


@pytest.mark.parametrize("case,match", [
    (dict(input_ids=None, batch="right"), "pads a prompt other than on the left"),
    (dict(num_beams=2), "num_beams"),
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(rift_rounds=True), "return_dict_in_generate"),
    (dict(rift_policy="full", rift_period=8), "rift_period only applies"),
    (dict(rift_policy="rift-ada"), "rift_controller"),
    (dict(rift_policy="nope"), "unknown policy"),
])
def test_what_a_round_cannot_honour_is_refused_in_one_line(lm_pair, case, match):
    (pair, ids), t = lm_pair, lm_pair[0].target
    case = dict(case)
    batch = case.pop("batch", None)
    if batch:
        case.pop("input_ids")
        ids = ids[:, :64].repeat(2, 1)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # right padding: not what a left-padded batch looks like
        case["attention_mask"] = mask
    with pytest.raises(ValueError, match=match) as err:
        t.generate(ids, max_new_tokens=8, custom_generate=rift_generate, **case)
    assert "\n" not in str(err.value)


def test_a_mask_of_another_shape_is_refused_in_one_line(lm_pair):
    """(generate itself drops such a mask before the loop sees it; called directly, the loop refuses it)"""
    (pair, ids), t = lm_pair, lm_pair[0].target
    with pytest.raises(ValueError, match="does not match input_ids") as err:
        from transformers import GenerationConfig

        cfg = GenerationConfig(num_beams=1, num_return_sequences=1, max_length=80, do_sample=False)
        rift_generate(t, ids[:, :64].repeat(2, 1), generation_config=cfg,
                      attention_mask=torch.ones(2, 10, dtype=torch.long))
    assert "\n" not in str(err.value)
