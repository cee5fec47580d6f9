"""Batched speculative decoding (``rift_ada.batch``): lossless per row, rows independent of each other and of the
padding, a RIFT cache and a refresh per row, finished rows leaving, and bad input refused in one line."""

import collections
import functools
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2

from torch._dynamo.utils import counters

from rift_ada.architectures import FAMILIES, UnsupportedModelError, family
from rift_ada.batch import BatchDecoder, batched_greedy, decide_rows, joint_rows
from rift_ada.data import build_tasks, encode
from rift_ada.evaluate import decode
from rift_ada.models import greedy_reference
from rift_ada.policies import make_policy
from rift_ada.refresh.loader import load_controller
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import random_model
from tests.test_sampling import ALPHA, K, NEW_TOKENS, SAMPLES, VOCAB, chi_square, models, sequence_distribution

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "experiments" / "results" / "controller-8k" / "controller-tree.json"
NEW = [80, 5, 40]  # each row its own max_new_tokens: the middle row leaves within 4 rounds, the first takes >= 7


@pytest.fixture(scope="module")
def ragged_prompts(tokenizer):
    """Three held-out prompts of different lengths (1024, 700 and 450 tokens) and kinds: rows drift apart."""
    tasks = [build_tasks(tokenizer, f, n=1, input_tokens=1024, seed=5)[0] for f in ("low", "sort", "low")]
    ids = [encode(tokenizer, t.prompt) for t in tasks]
    return [ids[0], ids[1][:700], ids[2][-450:]]


@pytest.fixture(scope="module")
def references(testbed_target, ragged_prompts):
    return [greedy_reference(testbed_target, p, n) for p, n in zip(ragged_prompts, NEW)]


def policy(name):
    controller = load_controller(TREE) if name == "learned" else None
    return make_policy("rift-ada" if name == "learned" else name, budget=None if name == "full" else 256,
                       period=8 if name == "rift-dyn" else None, controller=controller)


def run(dec, prompts, new, controller):
    dec.reset(prompts, new)
    rounds = list(dec.rounds(lambda states: decide_rows(controller, states)))
    return rounds


@pytest.mark.parametrize("name", ["full", "window", "snapkv", "rift-stat", "rift-dyn", "learned"])
@pytest.mark.parametrize("drafter", ["self", "external"])
def test_batched_greedy_equals_each_rows_own_greedy(name, drafter, testbed_target, testbed_draft, ragged_prompts,
                                                    references):
    pol = policy(name)
    dec = BatchDecoder(testbed_target, None if drafter == "self" else testbed_draft, pol.layout, draft_length=11)
    rounds = run(dec, ragged_prompts, NEW, pol.controller)
    assert [r.tokens for r in dec.results] == references
    refreshes = sum(r.refreshes for r in dec.results)
    if name != "learned":  # the learned controller refreshes where it reads staleness, maybe nowhere here
        assert (refreshes > 0) == (name == "rift-dyn")
    # A row that ended (its own max_new_tokens) left the batch: the rounds after it neither record nor feed it.
    for i, res in enumerate(dec.results):
        assert [i in r.records for r in rounds] == [j < len(res.rounds) for j in range(len(rounds))]
    assert min(len(r.rounds) for r in dec.results) < len(rounds)


@pytest.mark.parametrize("step", ["model", "static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_row_decodes_as_its_own_decoder(temperature, step, testbed_target, testbed_draft, ragged_prompts):
    """Row i of a batch draws, accepts, refreshes and records exactly what a single decoder seeded seed + i does on
    that prompt alone: nothing of a row (its tokens, its acceptance per round, its signals) depends on the other
    rows or on how much they pad it; on the model's forwards and on the static steps (there against a single
    decoder on the static steps: each row draws its drafts from its own uniforms, as that decoder does)."""
    pol = policy("rift-dyn")
    dec = BatchDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11, temperature=temperature, seed=3,
                       draft_step=step, verify_step=step)
    run(dec, ragged_prompts, NEW, pol.controller)
    for i, (prompt, new) in enumerate(zip(ragged_prompts, NEW)):
        alone = SpeculativeDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11,
                                   temperature=temperature, seed=3 + i, draft_step=step, verify_step=step)
        res = decode(alone, prompt, new, pol.controller)
        mine = dec.results[i]
        assert mine.tokens == res.tokens
        assert [(r.accepted, r.refreshed) for r in mine.rounds] == [(r.accepted, r.refreshed) for r in res.rounds]
        assert [r.runway for r in mine.rounds] == pytest.approx([r.runway for r in res.rounds], abs=1e-3)
        # The draft's entropy at each step: what it computed, not only what it chose (a mask that lets a query see
        # one tail entry too many moves it, though it rarely moves an argmax).
        assert [r.entropy_mean for r in mine.rounds] == pytest.approx([r.entropy_mean for r in res.rounds], abs=1e-4)


@pytest.mark.parametrize("name", ["full", "rift-stat", "rift-dyn", "learned"])
@pytest.mark.parametrize("drafter", ["self", "external"])
def test_static_batched_greedy_is_lossless_and_reads_the_device_once_a_round(name, drafter, testbed_target,
                                                                            testbed_draft, ragged_prompts,
                                                                            references):
    """Both static steps over the batch: every row's draft in one arena, every row's verify in one block, the
    acceptance on the device, and each round's outcomes (every row's) read back at once."""
    pol = policy(name)
    dec = BatchDecoder(testbed_target, None if drafter == "self" else testbed_draft, pol.layout, draft_length=11,
                       draft_step="static", verify_step="static")
    rounds = run(dec, ragged_prompts, NEW, pol.controller)
    assert [r.tokens for r in dec.results] == references
    assert dec.host_reads == len(rounds)
    if name == "rift-dyn":
        assert dec.results[0].refreshes >= 3


@pytest.mark.slow
def test_compiled_batch_runs_one_graph_per_step_for_a_whole_generation(testbed_target, testbed_draft, ragged_prompts,
                                                                       references):
    """Compiled, a batch of 4 (rows of three lengths, one ending early and idling on) decodes rift-dyn with
    refreshes on one graph for the draft step and one for the verify (fullgraph: a break would raise): shapes are
    (rows, capacity) and (rows, k + 1) whatever the rows' lengths, refreshes and endings. Lossless, one read a
    round."""
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    pol = policy("rift-dyn")
    dec = BatchDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11, draft_step="compiled",
                       verify_step="compiled")
    prompts, new = ragged_prompts + [ragged_prompts[0][-300:]], NEW + [24]
    rounds = run(dec, prompts, new, pol.controller)
    assert [r.tokens for r in dec.results[:3]] == references
    assert dec.results[3].tokens == greedy_reference(testbed_target, prompts[3], 24)
    assert sum(r.refreshes for r in dec.results) >= 3 and dec.host_reads == len(rounds)
    assert counters["stats"]["unique_graphs"] - graphs == 2


def test_a_refresh_rescores_its_own_row_only(testbed_target, testbed_draft, ragged_prompts):
    pol = policy("rift-dyn")
    dec = BatchDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11)
    dec.reset(ragged_prompts, 200)
    with pytest.raises(ValueError, match="2 refresh decisions for 3 live rows"):
        dec.step(refresh=[True, False])
    for _ in range(3):
        dec.step()
    before = [r.dcache.rift_layers[0].imp_pos.clone() for r in dec.rows]
    out = dec.step(refresh=[False, True, False])
    after = [r.dcache.rift_layers[0].imp_pos for r in dec.rows]
    assert [rec.refreshed for rec in out.records.values()] == [False, True, False]
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert not torch.equal(before[1], after[1])  # 3 rounds of generated text moved row 1's selection


def test_a_joint_controller_decides_each_row_at_its_own_length_along_the_generation(testbed_target, testbed_draft,
                                                                                   ragged_prompts):
    """A context-length table (k by prompt + generated tokens) as the batch's joint controller: at every round each
    live row is priced at its own length as it grows (its prompt plus what it generated by then), and the round
    drafts the k most rows chose (ties: the larger). Lossless throughout."""
    from rift_ada.joint.control import LengthTable

    seen = []

    class Recording(LengthTable):
        def act(self, state):
            seen.append(state.prompt_tokens + state.generated)
            return super().act(state)

    table = Recording(lengths=(0, 470, 720, 1040), ks=(11, 5, 3, 1), period=16)
    dec = BatchDecoder(testbed_target, testbed_draft, policy("rift-dyn").layout, draft_length=11)
    dec.reset(ragged_prompts, 64)
    expected, chosen = [], []
    while not dec.done:
        lengths = [len(ragged_prompts[i]) + len(dec.rows[i].result.tokens) for i in dec.live]
        expected += lengths
        refresh, k = joint_rows(table, dec.states)
        wants = [table.ks[max(i for i, n in enumerate(table.lengths) if n <= x)] for x in lengths]
        assert k == max(set(wants), key=lambda w: (wants.count(w), w))
        chosen.append(k)
        dec.step(refresh, k)
    assert seen == expected
    assert len(set(chosen)) >= 2  # rows crossed the table's lengths as they grew: the round's k moved
    for prompt, res in zip(ragged_prompts, dec.results):
        assert res.tokens == greedy_reference(testbed_target, prompt, 64)


def test_draft_kv_is_batch_times_budget_flat_in_context():
    """The batch's draft KV at its largest round: rows x (budget + the round in flight) x bytes per token, the same
    at every prompt length (measured on the real cache's buffers)."""
    target = random_model("llama", layers=2, seed=0)
    draft = random_model("llama", layers=1, seed=1)
    cfg = draft.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * draft.dtype.itemsize
    pol = make_policy("rift-dyn", budget=32, period=4, obs_window=8)
    peaks = []
    for length in (128, 512, 1024):
        prompts = [torch.randint(0, 128, (length - 7 * i,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(8)]
        dec = BatchDecoder(target, draft, pol.layout, draft_length=4)
        rounds = run(dec, prompts, 16, pol.controller)
        settled = [r.dcache.active_tokens() for r in dec.rows]
        assert settled == [32] * 8  # after the last round: the budget, per row
        peaks.append(max(sum(rec.active_kv_bytes for rec in r.records.values()) for r in rounds))
    assert peaks[0] == peaks[1] == peaks[2] <= 8 * (32 + 4 + 1) * per_token


KEYS = [f.key for f in FAMILIES]


@functools.lru_cache(maxsize=None)
def family_pair(key):
    other = FAMILIES[(KEYS.index(key) + 1) % len(FAMILIES)]
    return family(key).model(seed=0, window=16), other.model(seed=1, layers=2, window=16)


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS)
def test_families_batched_greedy_equals_greedy(key):
    """Dense, sliding-window and hybrid families (a hybrid target's states roll back per row), self and external
    drafts, a full and a rift-dyn draft cache, prompts of 80, 57 and 95 tokens in one batch."""
    target, external = family_pair(key)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (80, 57, 95)]
    refs = [greedy_reference(target, p, 32) for p in prompts]
    for draft in (None, external):
        for name in ("full", "rift-dyn"):
            pol = make_policy(name, None if name == "full" else 24, period=8 if name == "rift-dyn" else None,
                              obs_window=8)
            dec = BatchDecoder(target, draft, pol.layout, draft_length=4)
            run(dec, prompts, 32, pol.controller)
            assert [r.tokens for r in dec.results] == refs, (draft is None, name)


@pytest.mark.slow
def test_batch_of_four_samples_the_targets_distribution():
    """The suite's exact-distribution check (tests/test_sampling.py) for a batch of 4: rows 0 and 2 decode one
    prompt, rows 1 and 3 another of another length, rift-dyn refreshing every round; each prompt's 4-token
    sequences must follow the target's own distribution (chi-square at alpha 1e-3). (On the static steps each row
    reproduces a single static decoder exactly, whose distribution tests/test_sampling.py checks:
    ``test_each_row_decodes_as_its_own_decoder[1.0-static]``.)"""
    target, draft, prompt = models()
    other = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(2)).tolist()
    dists = [sequence_distribution(target, p, NEW_TOKENS, 1.0, 1.0)[0] for p in (prompt, other)]
    pol = make_policy("rift-dyn", budget=12, period=1, obs_window=8)
    dec = BatchDecoder(target, draft, pol.layout, draft_length=K, temperature=1.0)
    counts = [collections.Counter(), collections.Counter()]
    for s in range(SAMPLES // 2):
        dec.template.seed = 4 * s
        run(dec, [prompt, other, prompt, other], NEW_TOKENS, pol.controller)
        for i, r in enumerate(dec.results):
            counts[i % 2][tuple(r.tokens)] += 1
    for c, dist in zip(counts, dists):
        assert not {s for s in c if dist.get(s, 0.0) == 0.0}
        stat, dof = chi_square(c, dist, SAMPLES)
        assert stat < chi2.ppf(1 - ALPHA, dof), f"chi-square {stat:.1f} (dof {dof})"


def test_batched_plain_greedy_equals_greedy(testbed_target, ragged_prompts, references):
    out, _ = batched_greedy(testbed_target, ragged_prompts, NEW)
    assert out == references


def test_bad_batches_are_refused_in_one_line(testbed_target, testbed_draft):
    pol = policy("rift-dyn")
    dec = BatchDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11)
    limit = testbed_target.config.max_position_embeddings
    cases = [([], 8, "holds no prompts"), ([[1, 2], []], 8, "prompt 1 of the batch is empty"),
             ([[1, 2], [3] * (limit - 4)], 8, "row 1 of the batch: prompt"),
             ([[1, 2], [3, 4]], [8], "1 max_new_tokens for a batch of 2")]
    for prompts, new, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            dec.reset(prompts, new)
        assert "\n" not in str(e.value)
    small = BatchDecoder(testbed_target, testbed_draft, pol.layout, draft_length=11, memory_limit=1 << 20)
    with pytest.raises(ValueError, match="GiB of caches, more than"):
        small.reset([[1] * 2000] * 8, 64)

    class Joint:  # decides (refresh, draft length) from one state: not a per-row refresh
        def act(self, state):
            return True, 3

    dec.reset([[1, 2, 3], [4, 5]], 8)
    with pytest.raises(ValueError, match="cannot decide a refresh per row"):
        decide_rows(Joint(), dec.states)
    with pytest.raises(ValueError, match="runs both steps the same way"):
        BatchDecoder(testbed_target, testbed_draft, pol.layout, draft_step="static")
    with pytest.raises(UnsupportedModelError, match="needs every layer to be full attention") as e:
        BatchDecoder(*family_pair("qwen3-swa"), pol.layout, draft_step="static", verify_step="static")
    assert "\n" not in str(e.value)


def test_evaluate_decodes_in_batches_with_the_same_summary():
    """``python -m rift_ada.evaluate --batch-size 2`` over 3 prompts (a last batch of one): every output the
    target's own greedy one, the same acceptance as one prompt at a time (rows decode as their own decoders), and a
    static step the batch cannot pair with a model step refused in one line."""
    from rift_ada.evaluate import build_parser, run

    base = ["--policy", "rift-dyn", "--period", "8", "--budget", "128", "--prompts", "3", "--max-new-tokens", "16",
            "--input-tokens", "512", "--json"]
    batched = run(build_parser().parse_args([*base, "--batch-size", "2"]))
    alone = run(build_parser().parse_args([*base, "--no-greedy-check"]))
    assert batched["batch_size"] == 2 and batched["target_greedy_match"] == 1.0
    assert batched["acceptance_length"] == pytest.approx(alone["acceptance_length"])
    assert batched["refreshes"] == alone["refreshes"]
    with pytest.raises(ValueError, match="runs both steps the same way"):
        run(build_parser().parse_args([*base, "--batch-size", "2", "--draft-step", "static"]))
    # A joint controller file: each row's refresh, one k a round (joint_rows), still the target's own output.
    joint = ROOT / "experiments" / "results" / "joint-7k-16k" / "controller-joint-ppo.pt"
    out = run(build_parser().parse_args(["--policy", "rift-ada", "--controller", str(joint), "--budget", "128",
                                         "--prompts", "2", "--max-new-tokens", "16", "--input-tokens", "512",
                                         "--json", "--batch-size", "2"]))
    assert out["target_greedy_match"] == 1.0 and out["batch_size"] == 2
