import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import random_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "compression_gap.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def eager_group_attention(model, ids):
    """Independent: the model's own eager attention weights (output_attentions), summed over each KV group."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        att = eager(ids, output_attentions=True, use_cache=False).attentions
    hk = model.config.num_key_value_heads
    return [a.reshape(a.shape[0], hk, -1, *a.shape[2:]).sum(2) for a in att]


@pytest.fixture(scope="module")
def lm():
    from rift_ada.models import load_model

    return load_model("testbed-lm")


@pytest.mark.parametrize("which", ["random", "testbed-lm"])
def test_hindsight_keeps_the_top_attention_keys(which, lm):
    from rift_ada.trainers import compressibility as C
    from rift_ada.trainers import compression_gap as G

    model = random_model(layers=2, heads=4, kv_heads=2) if which == "random" else lm
    n, p, budget = (48, 32, 8) if which == "random" else (160, 128, 20)
    ids = torch.randint(0, min(model.config.vocab_size, 128), (1, n), generator=torch.Generator().manual_seed(3))
    capture = C.dense_capture(model, ids)
    masks = G.hindsight_masks(model, ids, p, budget, capture=capture, block=5)  # blocks that do not divide the rows
    ref = eager_group_attention(model, ids)
    scalings = G.attention_scalings(model)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert len(masks) == model.config.num_hidden_layers
    for i, (m, att) in enumerate(zip(masks, ref)):
        assert m.shape == (1, model.config.num_key_value_heads, n, n)
        assert torch.equal(m[:, :, :p], causal[:p].expand_as(m[:, :, :p]))  # prompt rows: causal
        assert not (m & ~causal).any()  # no future key anywhere
        rows = torch.arange(p, n)
        ours = G.group_attention(capture.layers[i].queries, capture.layers[i].keys, rows, scalings[i])
        torch.testing.assert_close(ours, att[:, :, p:], atol=1e-5, rtol=1e-4)  # the same probabilities
        for t in range(p, n):
            row = m[0, :, t]
            assert (row.sum(-1) == min(budget, t + 1)).all()
            w = att[0, :, t]
            kept_min = torch.where(row, w, torch.inf).min(-1).values
            dropped_max = torch.where(~row & causal[t], w, -torch.inf).max(-1).values
            assert (kept_min >= dropped_max - 1e-6).all(), (i, t)  # the top ones, up to float ties


def test_hindsight_at_a_budget_covering_everything_is_the_full_cache():
    from rift_ada.trainers import compressibility as C
    from rift_ada.trainers import compression_gap as G

    model = random_model(layers=2, heads=4, kv_heads=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    masks = G.hindsight_masks(model, ids, 24, 40)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    assert all(torch.equal(m[0, h], causal) for m in masks for h in range(2))
    with torch.no_grad():
        full = C.continuation_logits(model, ids, None, 24)
        hind = C.continuation_logits(model, ids, masks, 24)
    torch.testing.assert_close(hind, full, atol=1e-5, rtol=1e-4)
    # A smaller budget changes them (the masks are used).
    small = G.hindsight_masks(model, ids, 24, 3)
    with torch.no_grad():
        assert not torch.allclose(C.continuation_logits(model, ids, small, 24), full, atol=1e-4)


def simulate_rounds(a, k, rng):
    """Monte-Carlo: each draft accepted independently with probability a_t; rounds of up to k drafts + 1."""
    s, rounds = 0, 0
    while s < len(a):
        n = 0
        while n < k and s + n < len(a) and rng.random() < a[s + n]:
            n += 1
        rounds, s = rounds + 1, s + n + 1
    return rounds


def test_rounds_al_by_hand_and_against_simulation():
    from rift_ada.trainers.compression_gap import rounds_al

    k = 4
    # All accepted: every round k drafts + 1 (20 tokens = 4 rounds of 5).
    assert rounds_al([1] * 20, k, 0) == 5.0 and rounds_al([1.0] * 20, k, 1) == pytest.approx(5.0)
    # The last round is cut by the end: 12 tokens = 5 + 5 + 2.
    assert rounds_al([1] * 12, k, 0) == 12 / 3
    # None accepted: every round yields the target's token only.
    assert rounds_al([0] * 7, k, 0) == 1.0 and rounds_al([0.0] * 7, k, 1) == pytest.approx(1.0)
    # Alternating 1, 0: each round accepts one draft, the target replaces the miss: 2 tokens a round.
    assert rounds_al([1, 0] * 6, k, 0) == 2.0
    # 0, 1, 1, ...: the first round misses at once, then the rest (7 tokens) in rounds of 5 and 2.
    assert rounds_al([0] + [1] * 7, k, 0) == 8 / 3
    # Runs longer than k are capped: [1]*6 + [0] -> rounds cover 5, then 1 accepted + the miss replaced (2).
    assert rounds_al([1] * 6 + [0], k, 0) == 7 / 2
    # The DP on 0/1 vectors is the exact simulation.
    rng = random.Random(0)
    for _ in range(50):
        v = [int(rng.random() < 0.7) for _ in range(rng.randrange(1, 40))]
        assert rounds_al([float(x) for x in v], k, 1) == pytest.approx(rounds_al(v, k, 0))
    # T=1: the DP's expected rounds match a Monte-Carlo simulation.
    a = [rng.uniform(0.3, 1.0) for _ in range(60)]
    sims = [simulate_rounds(a, k, rng) for _ in range(20000)]
    assert rounds_al(torch.tensor(a), k, 1) == pytest.approx(len(a) / (sum(sims) / len(sims)), rel=0.01)
    with pytest.raises(ValueError):
        rounds_al(a, k, 0.5)


def test_t_interval_matches_scipy():
    from scipy import stats

    from rift_ada.trainers.compression_gap import mean_interval, t_quantile

    for df in (1, 4, 7, 29, 30, 31, 60, 200):
        assert t_quantile(df) == pytest.approx(stats.t.ppf(0.975, df), rel=2e-4)
    v = [1.0, 2.5, 3.0, 2.0]
    m, lo, hi = mean_interval(v)
    ref = stats.t.interval(0.95, len(v) - 1, loc=m, scale=stats.sem(v))
    assert m == 2.125 and (lo, hi) == pytest.approx(ref, rel=1e-4)
    assert mean_interval([3.0]) == (3.0, None, None)


def test_the_script_end_to_end_with_an_adapter(tmp_path, lm):
    """One short prompt: every setting and gap is written; the self-drafter on its full cache agrees everywhere (so
    AL at T=0 is k + 1 a round, the last cut short); an untrained adapter (zero delta) changes nothing."""
    from rift_ada import lora

    adapter = tmp_path / "adapter"
    lora.save(lora.attach(copy.deepcopy(lm), rank=4), lora.fingerprint(lm), adapter)
    out = tmp_path / "gap.json"
    res = run("--target", "testbed-lm", "--source-dir", "pip", "--prompts", "1", "--input-tokens", "512",
              "--new-tokens", "16", "--budgets", "0.0625", "0.25", "--period", "4", "--lora", str(adapter),
              "--targets-dir", str(tmp_path / "targets"), "--output", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "reading gap" in res.stdout and "selection gap vs dyn" in res.stdout
    results = json.loads(out.read_text())["results"]
    assert len(results) == 2
    base, adapted = results
    rows = {(r["setting"], r["budget_fraction"]): r for r in base["rows"]}
    assert set(rows) == {("full", None)} | {(s, b) for s in ("rift-stat", "rift-dyn", "hindsight")
                                            for b in (0.0625, 0.25)}
    full = rows["full", None]
    assert full["top1"] == 1.0 and full["al_t0"] == 15 / 2  # 15 drafted positions, k = 11: rounds of 12 and 3
    for r in rows.values():
        assert 1.0 <= r["al_t0"] <= 12 and 1.0 <= r["al_t1"] <= 12 and 0 <= r["accept"] <= 1
    for g in base["gaps"]:
        hind = rows["hindsight", g["budget_fraction"]][f"al_t{g['temperature']}"]
        assert g["reading_gap"] == pytest.approx(full[f"al_t{g['temperature']}"] - hind)
        assert g["selection_gap_stat"] == pytest.approx(
            hind - rows["rift-stat", g["budget_fraction"]][f"al_t{g['temperature']}"])
    for a, b in zip(base["rows"], adapted["rows"]):
        assert a["al_t1"] == pytest.approx(b["al_t1"], abs=1e-4) and a["al_t0"] == b["al_t0"]
    changes = json.loads(out.read_text())["adapter_changes"]
    assert len(changes) == 2 * len(base["rows"]) and "the adapter: AL untrained -> trained" in res.stdout
    for c in changes:
        assert c["relative_change"] == pytest.approx(0, abs=1e-5) and c["change_low"] <= c["change_high"]
        assert (c["setting"] == "hindsight") == ("reading_gap" in c)


def test_adapter_changes_and_the_recovered_share():
    """By hand: the reading gap is full - hindsight of the untrained drafter; the adapter's hindsight gain over it is
    the share recovered."""
    from rift_ada.trainers.compression_gap import adapter_changes

    def rows(full, hind):
        pp = lambda v: {"al_t1": v, "al_t0": v}  # noqa: E731
        return [{"setting": "full", "budget_fraction": None, "per_prompt": pp(full)},
                {"setting": "hindsight", "budget_fraction": 0.125, "per_prompt": pp(hind)}]

    out = adapter_changes(rows([10.0, 12.0], [9.0, 11.0]), rows([10.0, 12.0], [9.5, 11.5]))
    hind = [c for c in out if c["setting"] == "hindsight"]
    assert [c["recovered"] for c in hind] == [0.5, 0.5] and hind[0]["reading_gap"] == 1.0
    assert hind[0]["relative_change"] == pytest.approx(21 / 20 - 1)
    assert [c["recovered"] for c in out if c["setting"] == "full"] == [None, None]


@pytest.mark.parametrize("args, message", [
    (["--budgets", "0"], "--budgets are fractions of the prompt in (0, 1]"),
    (["--budgets", "0.1", "1.5"], "--budgets are fractions of the prompt in (0, 1]"),
    (["--period", "0"], "--period must be >= 1"),
])
def test_bad_input_is_one_line(args, message):
    res = run(*args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2  # argparse: the usage line and the error
