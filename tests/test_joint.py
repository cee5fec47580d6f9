"""Joint controllers (rift_ada.joint): each round's refresh and draft length (0: a plain target step), priced by round
costs measured on the machine; learned on replay (trainers/joint.py, ``train_controller.py --joint``), run by the
decoder, ``evaluate``, ``rift_generate`` and the bench, lossless at every k they choose."""

import json
import warnings
from dataclasses import replace

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from rift_ada.evaluate import decode
from rift_ada.joint import (FixedJoint, JointController, JointPolicy, RoundCosts, actions, check_joint,
                            measure_round_costs)
from rift_ada.layout import CacheLayout
from rift_ada.models import greedy_reference
from rift_ada.refresh.loader import load_controller
from rift_ada.speculative import Decoding, SpeculativeDecoder
from tests.conftest import cached_testbed_pair, script_module
from tests.test_replay import table

COSTS = RoundCosts((256, 1024), (1, 2, 4), ((0.010, 0.014, 0.016), (0.020, 0.026, 0.030)), (0.002, 0.003),
                   (0.004, 0.012), 64, "model")
LAYOUT = CacheLayout("rift", budget=64, refresh_grid=4)


def prompt(family: str = "low", tokens: int = 512, seed: int = 0) -> list[int]:
    from rift_ada.data import build_tasks, encode

    pair = cached_testbed_pair("testbed")
    return encode(pair.tokenizer, build_tasks(pair.tokenizer, family, n=1, input_tokens=tokens, seed=seed)[0].prompt)


def test_round_costs_interpolate_extend_round_trip_and_say_where_they_were_measured():
    c = COSTS
    assert c.verify(1, 256) == pytest.approx(0.010) and c.verify(1, 640) == pytest.approx(0.015)
    assert c.verify(3, 256) == pytest.approx(0.015)  # between the measured widths 2 and 4
    assert c.verify(1, 1792) == pytest.approx(0.030)  # the last segment's line, extended
    assert c.round_seconds(3, True, 256) == pytest.approx(3 * 0.002 + 0.016 + 0.004)
    assert c.round_seconds(0, False, 1024) == pytest.approx(0.020)  # a plain target step
    assert c.round_seconds(3, False, 256, missed=9) == c.round_seconds(3, False, 256)  # no catch-up measured
    caught = replace(c, missed=(1, 8), catch_up_s=((0.001, 0.008), (0.002, 0.016)))
    assert caught.catch_up(4, 256) == pytest.approx(0.004) and caught.catch_up(8, 1024) == pytest.approx(0.016)
    assert caught.catch_up(24, 1024) == pytest.approx(0.048)  # beyond the last count: in proportion (chunks)
    assert caught.round_seconds(2, False, 640, missed=1) == pytest.approx(2 * 0.0025 + 0.0215 + 0.0015)
    assert caught.round_seconds(0, False, 640, missed=8) == pytest.approx(0.015)  # a plain step reads no draft
    assert RoundCosts.from_dict(caught.to_dict()) == caught
    old = {k: v for k, v in c.to_dict().items() if k not in ("missed", "catch_up_s")}  # a file from before
    assert RoundCosts.from_dict(old) == c
    assert RoundCosts.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="not a round-cost model"):
        RoundCosts.from_dict({"lengths": [1]}, "f.pt")
    with pytest.raises(ValueError, match="increasing"):
        replace(c, lengths=(1024, 256))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.check(budget=64, steps="model") == []
    with pytest.warns(UserWarning, match="another machine.*cpu 'elsewhere'"):
        replace(c, machine={**c.machine, "cpu": "elsewhere"}).check()
    with pytest.warns(UserWarning, match="budget 64, not 128"):
        c.check(budget=128)


def constant_policy(predicts: str, tokens=(1.0, 1.5)) -> JointPolicy:
    """A learned controller whose scores are constant: k = 0 scores tokens[0], k = 2 tokens[1]."""
    import torch

    from rift_ada.joint.control import NAMES
    from rift_ada.refresh.mlp import build_mlp

    net = build_mlp([len(NAMES), 2], "tanh")
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.copy_(torch.tensor(tokens))
    return JointPolicy(net, [(False, 0), (False, 2)], COSTS, np.zeros(len(NAMES)), np.ones(len(NAMES)),
                       "priced", predicts=predicts)


def test_a_tokens_controller_is_priced_by_the_costs_of_the_machine_it_decides_on(tmp_path):
    """Expected tokens 1.0 (plain step) and 1.5 (draft 2): at 256 tokens COSTS price a k = 2 round at 1.9 plain
    steps (2 drafts of 2 ms, a verify of 3 of 15 ms, a plain step 10 ms), so it steps plainly; on a machine whose
    verify is nearly a plain step's (11 ms, drafts 0.5 ms: 1.2) it drafts. A gain controller's scores are priced
    already: the same net drafts whatever the costs."""
    from rift_ada.signals import DecoderState

    state = DecoderState(0, 64, 0, 0, 0.0, (), 0.0, 0.0, 100, prompt_tokens=256)
    cheap = replace(COSTS, verify_s=((0.010, 0.011, 0.011), (0.020, 0.022, 0.022)), draft_s=(0.0005, 0.0005))
    c = constant_policy("tokens")
    assert c.price(state) == pytest.approx([1.0, 1.9])
    assert c.act(state) == (False, 0)
    c.prices = cheap
    assert c.price(state) == pytest.approx([1.0, 1.2]) and c.act(state) == (False, 2)
    g = constant_policy("gain")
    assert g.act(state) == (False, 2) and not g.price(state).any()
    c.save(tmp_path / "c.pt")
    again = JointPolicy.load(tmp_path / "c.pt")
    assert again.predicts == "tokens" and again.prices is None and again.act(state) == (False, 0)
    with pytest.raises(ValueError, match="one of gain, tokens"):
        constant_policy("seconds")


def test_measured_costs_come_from_real_rounds():
    pair = cached_testbed_pair("testbed")
    dec = SpeculativeDecoder.for_pair(pair, LAYOUT, Decoding(4, draft_step="static", verify_step="static"))
    c = measure_round_costs(dec, {512: prompt(tokens=512), 1024: prompt(tokens=1024)}, (0, 2, 4), repeats=3,
                            missed=(1, 48))
    assert c.lengths == (512, 1024) and c.blocks == (1, 3, 5) and c.budget == 64 and c.steps == "static"
    # one measured time per (length, missed count); which is dearer, or whether a one-token catch-up measures above
    # the noise at all (measure_round_costs clamps a noisy difference at 0), is the machine's to say: a timing
    assert c.missed == (1, 48) and all(len(row) == 2 and min(row) >= 0 for row in c.catch_up_s)
    assert all(np.isfinite(row).all() for row in c.catch_up_s)
    assert all(np.all(np.diff(row) >= 0) for row in c.verify_s)  # a wider verify never costs less
    assert min(c.draft_s) > 0 and min(c.refresh_s) > 0 and c.machine["threads"] >= 1
    with pytest.raises(ValueError, match="stay <= the decoder's k"):
        measure_round_costs(dec, {512: prompt(tokens=512)}, (0, 8))


class RandomJoint(JointController):
    """Every (refresh, k) choice at random: the lossless check's adversary."""

    def __init__(self, choices, seed=0):
        self.choices, self.rng = choices, np.random.default_rng(seed)

    @property
    def k_max(self):
        return max(k for _, k in self.choices)

    def act(self, state):
        return self.choices[int(self.rng.integers(len(self.choices)))]


@pytest.mark.parametrize("step", ["model", "static"])
def test_greedy_is_lossless_with_a_joint_controller_at_every_k_it_chooses(step):
    pair = cached_testbed_pair("testbed")
    dec = SpeculativeDecoder.for_pair(pair, LAYOUT, Decoding(4, draft_step=step, verify_step=step))
    ids = prompt("sort")
    ref = greedy_reference(pair.target, ids, 64, pair.tokenizer.eos_token_id)
    res = decode(dec, ids, 64, RandomJoint(actions((0, 1, 2, 3, 4))))
    assert res.tokens == ref
    assert {r.draft_length for r in res.rounds} >= {0, 1, 2, 3, 4} and any(r.refreshed for r in res.rounds)
    with pytest.raises(ValueError, match="drafts up to 8 tokens a round, more than the decoder's draft length k = 4"):
        check_joint(FixedJoint(8, None), dec)


def test_plain_steps_leave_the_acceptance_signals_to_drafting_rounds():
    """A k = 0 round says nothing about the draft: the acceptance history and its long memory skip it, in the decoder
    and in its replay alike; the draft's read-ahead and drift stay as they were (nothing was fed to it)."""
    pair = cached_testbed_pair("testbed")
    dec = SpeculativeDecoder.for_pair(pair, LAYOUT, Decoding(4))
    dec.reset(prompt(), 32)
    first = dec.step(False, 4)
    before = dec.state
    dec.step(False, 0)
    after = dec.state
    assert after.acceptance == before.acceptance == (first.accepted / 4,)
    assert (after.drafted_total, after.accepted_total) == (4, first.accepted) and after.since_draft == 1
    assert (after.runway, after.focus, after.drift) == (before.runway, before.focus, before.drift)
    from rift_ada.replay.process import Replay

    r = Replay(table(0), 4)
    r.reset()
    rec = r.step(False, 4)
    r.step(False, 0)
    assert r.state.acceptance == (rec.accepted / 4,) and r.state.since_draft == 1 and r.state.drafted_total == 4


def test_suffix_match_finds_the_longest_repeated_suffix():
    from rift_ada.signals import suffix_match

    assert suffix_match(np.array([1, 2, 3, 9, 1, 2, 3])) == 3  # "1 2 3" came before
    assert suffix_match(np.array([1, 2, 3, 9, 4, 2, 3])) == 2
    assert suffix_match(np.array([5, 6])) == 0 and suffix_match(np.array([5])) == 0
    assert suffix_match(np.array([7, 7, 7, 7])) == 3  # overlapping occurrences count
    assert suffix_match(np.array([1, 2, 3, 4] * 10), cap=5) == 5


def test_the_target_and_copy_signals_are_read_off_plain_steps_as_the_target_gives_them():
    """target_p is the target's mean probability of its last emitted tokens (as a teacher-forced pass over the output
    gives them: a replay table's p), match the output's repeated suffix; both move during plain steps, with no draft
    run, and a replay over a table reads the same definitions."""
    import torch

    from rift_ada.replay.process import Replay
    from rift_ada.rounds import sampling_probs
    from rift_ada.signals import TARGET_WINDOW, suffix_match

    pair = cached_testbed_pair("testbed")
    dec = SpeculativeDecoder.for_pair(pair, LAYOUT, Decoding(4, temperature=1.0, seed=3))
    ids = prompt("sort")
    dec.reset(ids, 40)
    states = [dec.state]
    for k in [0] * 12 + [4, 0, 2, 0, 0]:
        if not dec.done:
            dec.step(False, k)
            states.append(dec.state)
    out = dec.result.tokens
    with torch.inference_mode():
        logits = pair.target(torch.tensor([ids + out]), logits_to_keep=len(out) + 1).logits[0, :len(out)]
    p = sampling_probs(logits, 1.0).gather(-1, torch.tensor(out)[:, None])[:, 0].numpy()
    for s in states:
        g = s.generated
        assert s.target_p == pytest.approx(p[max(g - TARGET_WINDOW, 0):g].mean(), abs=1e-4)
        assert s.match == suffix_match(np.asarray(ids + out[:g]))
    assert len({round(s.target_p, 4) for s in states[:12]}) > 3, "plain steps move target_p"
    t = table(0, temperature=1.0)
    r = Replay(t, 4)
    r.reset()
    for k in (0, 0, 3, 0):
        r.step(False, k)
    g = r.state.generated
    assert r.state.target_p == pytest.approx(t.p[g - TARGET_WINDOW:g].mean() if g >= TARGET_WINDOW else t.p[:g].mean())
    assert r.state.match == suffix_match(np.concatenate([t.prompt, t.tokens[:g]]))


def test_the_draft_catches_up_on_plain_steps_in_chunks_as_its_steps_would():
    """After a plain stretch the static draft catches up in CATCH_UP_CHUNK-token forwards (one per token would cost a
    draft step each): its drafts are those of the model path's forward, and its buffers keep their size."""
    from rift_ada.speculative import CATCH_UP_CHUNK

    pair = cached_testbed_pair("testbed")
    ids, records = prompt("low"), {}
    for step in ("model", "static"):
        dec = SpeculativeDecoder.for_pair(pair, LAYOUT, Decoding(4, draft_step=step, verify_step=step))
        dec.reset(ids, 2 * CATCH_UP_CHUNK + 40)
        sizes = [layer.capacity for layer in dec.dcache.rift_layers]
        records[step] = list(dec.rounds(lambda s: (False, 0 if s.generated < 2 * CATCH_UP_CHUNK + 8 else 4)))
        if step == "static":
            assert [layer.capacity for layer in dec.dcache.rift_layers] == sizes
    drafting = {s: [r for r in recs if r.draft_length] for s, recs in records.items()}
    assert [r.accepted for r in drafting["static"]] == [r.accepted for r in drafting["model"]]
    assert drafting["static"][0].accepted > 0
    np.testing.assert_allclose([r.entropy_mean for r in drafting["static"]],
                               [r.entropy_mean for r in drafting["model"]], atol=1e-3)


def test_the_joint_env_prices_rounds_by_the_costs_and_passes_gymnasium_checks():
    from rift_ada.envs.joint_env import JointReplayEnv

    env = JointReplayEnv([table(0, temperature=1.0)], COSTS, (0, 1, 2, 4))
    check_env(env, skip_render_check=True)
    assert env.action_space.n == len(actions((0, 1, 2, 4))) == 7

    def episode(seed):
        env.reset(seed=seed, options={"context": 512})
        rng, done, out = np.random.default_rng(seed), False, []
        while not done:
            _, reward, done, _, info = env.step(int(rng.integers(env.action_space.n)))
            out.append((reward, info["emitted"], info["seconds"], info["draft_length"]))
        return out

    run = episode(3)
    assert run == episode(3), "a seed fixes the episode (acceptance coin flips included)"
    _, info = env.reset(seed=3)
    assert info["context"] == env.tables[0].prompt_len, "an episode is priced at its own table's length"
    rewards, emitted, seconds, ks = map(np.array, zip(*run))
    np.testing.assert_allclose(rewards, emitted - seconds / COSTS.verify(1, 512))
    assert set(ks) >= {0, 1, 2, 4}
    with pytest.raises(ValueError, match="action must be in 0..6"):
        env.step(7)


@pytest.mark.slow
def test_the_live_joint_env_gives_the_replay_env_rewards_round_for_round():
    """Greedy, never refreshing, the replay is the decoder's rounds exactly (tests/test_replay.py): so the live env,
    priced by the same costs, gives the same rewards at the same actions, at every k."""
    from rift_ada.envs.joint_env import JointRefreshEnv, JointReplayEnv
    from tests.test_replay import NEW, prompts, shipped_pair

    lengths = (0, 1, 2, 4)
    live = JointRefreshEnv(SpeculativeDecoder.for_pair(shipped_pair(), LAYOUT, Decoding(4)), [list(prompts()[0])],
                           COSTS, lengths, NEW)
    replayed = JointReplayEnv([table(0, shipped=True)], COSTS, lengths)
    check_env(live, skip_render_check=True)
    plain = [i for i, (refresh, _) in enumerate(live.choices) if not refresh]
    o1, _ = live.reset(seed=0)
    o2, _ = replayed.reset(seed=0, options={"context": len(prompts()[0])})
    done, steps = False, 0
    while not done:
        a = plain[steps % len(plain)]
        o1, r1, done, _, i1 = live.step(a)
        o2, r2, done2, _, i2 = replayed.step(a)
        assert (r1, i1["emitted"], done) == pytest.approx((r2, i2["emitted"], done2)), steps
        assert o1[-5:-3].tolist() == o2[-5:-3].tolist(), "target_p and match read the same off both"
        steps += 1
    assert steps > 10


@pytest.fixture(scope="module")
def joint_run(tmp_path_factory):
    """A real, small ``train_controller.py --joint``: tables, measured costs, baselines, the gain family (DAgger) and
    PPO from its clone, exported."""
    out = tmp_path_factory.mktemp("joint")
    argv = ["--joint", "--joint-lengths", "512", "1024", "--draft-lengths", "0", "2", "4", "--draft-length", "4",
            "--joint-timesteps", "1024", "--train-sources", "stdlib", "--prompts-per-source", "2",
            "--eval-prompts", "1", "--input-tokens", "512", "--max-new-tokens", "48", "--train-new-tokens", "48",
            "--budget", "64", "--task", "low,high", "--workers", "1", "--wandb-mode", "offline",
            "--output-dir", str(out),
            "--target", "testbed-lm", "--drafter", "testbed-lm"]  # the trained pair: the job's path, not the copier
    assert script_module("train_controller").main(argv) == 0
    return out, argv


@pytest.mark.slow
def test_the_joint_job_exports_one_file_per_family_with_its_costs_and_baselines(joint_run, capsys):
    out, argv = joint_run
    summary = json.loads((out / "joint.json").read_text())
    assert set(summary["heldout_modelled"]) == {"greedy", "best_fixed", "length_table", "gain", "priced", "ppo"}
    assert summary["costs"]["lengths"] == [512, 1024] and summary["costs"]["blocks"] == [1, 3, 5]
    # training tables at each length, each priced at its own (grouped by the nearest measured length)
    assert len(list((out / "tables").glob("train-1024-*.safetensors"))) == 2
    assert set(summary["train_modelled"]["gain"]) == {"512", "1024", "all"}
    assert len(summary["heldout_modelled"]["greedy"]) == 2  # one held-out table: its length and "all"
    for family in ("gain", "priced", "ppo"):
        c = load_controller(out / f"controller-joint-{family}.pt")
        assert isinstance(c, JointPolicy) and c.family == family and c.k_max == 4
        assert c.predicts == ("tokens" if family == "priced" else "gain")
        assert c.baselines["best_fixed"]["kind"] == "fixed" and c.layout["budget"] == 64
        assert c.costs == RoundCosts.from_dict(summary["costs"])
    assert list((out / "wandb").glob("offline-run-*"))
    assert script_module("train_controller").main(argv + ["--resume"]) == 0  # a finished run: nothing to redo
    assert "holds a finished run" in capsys.readouterr().out


def test_trained_joint_controllers_are_lossless_in_decode_and_rift_generate(joint_run):
    import torch

    from rift_ada.hf import rift_generate

    out, _ = joint_run
    pair = cached_testbed_pair("testbed")
    ids = prompt("low", seed=5)
    eos = pair.tokenizer.eos_token_id
    ref = greedy_reference(pair.target, ids, 48, eos)
    for family in ("gain", "priced", "ppo"):
        c = load_controller(out / f"controller-joint-{family}.pt")
        dec = SpeculativeDecoder.for_pair(pair, c.cache_layout(), Decoding(4))
        assert decode(dec, ids, 48, c).tokens == ref
    x = torch.tensor([ids])
    got = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                               assistant_model=pair.draft, custom_generate=rift_generate, rift_budget=64,
                               rift_policy="rift-ada", rift_controller=str(out / "controller-joint-ppo.pt"),
                               rift_draft_length=4, pad_token_id=eos, eos_token_id=eos)
    assert got[0, len(ids):].tolist() == ref


def test_the_bench_compares_the_controller_with_greedy_and_the_fixed_settings(joint_run, tmp_path):
    out, _ = joint_run
    bench = script_module("bench_decode")
    report = tmp_path / "bench.json"
    argv = ["--controller", str(out / "controller-joint-gain.pt"), "--lengths", "512", "--prompts", "1",
            "--max-new-tokens", "24", "--repeats", "1", "--task", "low,high", "--temperature", "0",
            "--output", str(report)]
    assert bench.main(argv) == 0
    r = json.loads(report.read_text())
    assert r["best_fixed"].startswith(("k=", "speculate-never")) and r["costs"]["budget"] == 64
    (row,) = r["lengths"]
    for family in ("low", "high", "all"):
        table = "length_table" if "length_table" in row[family] else None  # left out: the best fixed setting's
        assert {"greedy", "best_fixed", "joint"} <= set(row[family]) and (table or "best fixed" in r["length_table"])
        assert all(v["tokens_per_s"] > 0 for k, v in row[family].items() if k not in ("same_output", "ratios"))
    for family in ("low", "high"):  # each family's own ratios, paired by prompt and repeat
        x = row[family]["ratios"]["joint_over_greedy"]
        assert x["ratio"] == pytest.approx(row[family]["joint"]["tokens_per_s"] / row[family]["greedy"]["tokens_per_s"])
        assert x["prompts_per_family"] == {family: 1}
    for base in ("best_fixed", "greedy"):  # one prompt per family: the interval is that prompt's ratio alone
        x = row["ratios"][f"joint_over_{base}"]
        assert x["ratio"] == pytest.approx(row["all"]["joint"]["tokens_per_s"] / row["all"][base]["tokens_per_s"])
        assert x["interval"] == pytest.approx([x["ratio"]] * 2) and x["prompts_per_family"] == {"low": 1, "high": 1}
    for family in ("low", "high"):
        assert all(row[family]["same_output"].values()), row[family]["same_output"]
        assert sum(row[family]["joint"]["k_share"].values()) == pytest.approx(1.0, abs=1e-3)  # shares to 4 places
    assert bench.main(argv[:-2] + ["--task", "nope"]) == 2


def test_the_bench_can_price_the_controller_by_costs_it_measures_there_first(joint_run, tmp_path):
    out, _ = joint_run
    report = tmp_path / "bench.json"
    argv = ["--controller", str(out / "controller-joint-priced.pt"), "--lengths", "512", "--prompts", "1",
            "--max-new-tokens", "24", "--repeats", "2", "--task", "low", "--temperature", "0", "--measure-costs",
            "--rows", "greedy,joint", "--output", str(report)]
    bench = script_module("bench_decode")
    assert bench.main(argv) == 0
    r = json.loads(report.read_text())
    (row,) = r["lengths"]
    assert r["rows"] == ["greedy", "joint"] and set(row["low"]) == {"greedy", "joint", "same_output", "ratios"}
    assert set(row["ratios"]) == {"joint_over_greedy"} and row["ratios"]["joint_over_greedy"]["repeats"] == 2
    assert r["costs"].startswith("measured at each length")
    measured = RoundCosts.from_dict(row["costs"])
    assert measured.lengths == (len(prompt("low")),) and measured.blocks == (1, 3, 5)  # the bench's own prompt
    assert measured != load_controller(out / "controller-joint-priced.pt").costs  # another measurement, another spell
    assert all(row["low"]["same_output"].values())
    assert all(v["modelled_tokens_per_s"] > 0 for k, v in row["low"].items() if k not in ("same_output", "ratios"))
    assert bench.main(argv[:-2] + ["--rows", "greedy,best_fixed"]) == 2  # no joint row: nothing to compare


def test_the_bench_runs_a_length_table_only_where_it_differs_from_the_best_fixed_setting():
    from rift_ada.studies.joint_bench import same_decisions
    from rift_ada.joint.control import LengthTable

    assert same_decisions(LengthTable((0, 1000), (1, 1), 64), FixedJoint(1, 64))
    assert not same_decisions(LengthTable((0, 1000), (1, 5), 64), FixedJoint(1, 64))
    assert not same_decisions(LengthTable((0, 1000), (1, 1), 32), FixedJoint(1, 64))
    assert same_decisions(LengthTable((0, 1000), (0, 0), 32), FixedJoint(0))  # never drafting: no period to differ
    assert not same_decisions(LengthTable((0,), (1,), 64), None)


def test_the_bench_ratio_interval_resamples_prompts_and_their_repeats():
    """Two prompts of one family, the joint row slow on the second: the point is tokens over seconds of both (0.8x),
    and the resampled interval runs from both picks of the second (0.5x) to both of the first (2x). One prompt whose
    second repeat ran slow is the same spread one level down: repeats are resampled too, paired with the base's."""
    from rift_ada.studies.joint_bench import ratio_interval

    x = ratio_interval({"low": {"joint": [[(100, 1.0)], [(100, 4.0)]], "best_fixed": [[(100, 2.0)], [(100, 2.0)]]}},
                       "joint", "best_fixed")
    assert x["ratio"] == pytest.approx(0.8) and x["interval"] == pytest.approx([0.5, 2.0])
    assert x["prompts_per_family"] == {"low": 2} and x["repeats"] == 1
    y = ratio_interval({"sort": {"joint": [[(100, 1.0), (100, 4.0)]], "greedy": [[(100, 2.0), (100, 2.0)]]}},
                       "joint", "greedy")
    assert y["ratio"] == pytest.approx(0.8) and y["interval"] == pytest.approx([0.5, 2.0]) and y["repeats"] == 2
    # paired: a slow spell that fell on both rows of a repeat leaves the ratio where it is
    z = ratio_interval({"sort": {"joint": [[(100, 1.0), (100, 3.0)]], "greedy": [[(100, 1.0), (100, 3.0)]]}},
                       "joint", "greedy")
    assert z["interval"] == pytest.approx([1.0, 1.0])


def test_the_bench_models_each_run_from_its_own_prefill():
    """A run that ends stepping plainly leaves nothing for the next run's draft to catch up on (that one starts from a
    prefill both caches read): the model of a row counts each run's catch-up from its own start."""
    from types import SimpleNamespace

    from rift_ada.studies.joint_bench import summarize

    costs = replace(COSTS, missed=(1, 8), catch_up_s=((0.001, 0.008), (0.002, 0.016)))

    def rnd(position, k, accepted=0):
        return SimpleNamespace(position=position, draft_length=k, accepted=accepted, emitted=accepted + 1,
                               refreshed=False)

    plain = ([0] * 5, 1.0, [rnd(i, 0) for i in range(1, 5)], 256)  # 4 plain steps after the prefill's token
    probe = ([0] * 3, 1.0, [rnd(1, 2, accepted=1)], 256)  # drafts at once: 2 drafts, 1 accepted
    row = summarize([plain, probe], costs)
    seconds = sum(costs.verify(1, 256 + i) for i in range(1, 5)) + costs.round_seconds(2, False, 257, missed=0)
    assert row["modelled_tokens_per_s"] == pytest.approx(6 / seconds)
    assert row["acceptance_length"] == 2.0 and row["k_share"] == {0: 0.8, 2: 0.2}


def test_joint_options_are_checked_with_joint_only(capsys):
    train_controller = script_module("train_controller")
    assert train_controller.parse_args(["--draft-length", "4"]).output_dir == "runs/controller"  # refresh-only job
    assert train_controller.parse_args(["--joint"]).output_dir == "runs/joint"
    with pytest.raises(SystemExit):
        train_controller.parse_args(["--joint", "--draft-length", "4"])  # the default set drafts up to 11
    assert "--draft-lengths must be integers in 0..--draft-length (4)" in capsys.readouterr().err


def test_the_signal_study_reads_tables_and_reports_what_the_signals_predict(tmp_path, capsys):
    """experiments/joint_signals.py (the figures docs/joint.md quotes): per table group, each signal's correlation with
    what k drafts would accept and the mean per signal bin, from real tables."""
    folder = tmp_path / "tables"
    folder.mkdir()
    for i in (0, 1):
        table(i, temperature=1.0).save(folder / f"train-{i:03d}-0.safetensors")
    table(0).save(folder / "heldout-000-0.safetensors")
    mod = script_module("joint_signals")
    assert mod.main([str(folder), "--k", "4", "--stride", "2", "--output", str(tmp_path / "s.json")]) == 0
    report = json.loads((tmp_path / "s.json").read_text())
    assert {k.split()[0] for k in report} == {"heldout", "train"}  # grouped by split and nearest whole K
    train = next(v for k, v in report.items() if k.startswith("train"))
    assert train["points"] > 10 and 0 <= train["accepted_mean"] <= 4
    assert sum(b["n"] for b in train["by_match"].values()) == train["points"]
    assert "correlation target_p" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mod.parse_args([str(tmp_path / "missing")])


def test_plain_step_overhead_times_the_loop_apart_from_the_forward(capsys):
    """experiments/plain_step_overhead.py (docs/joint.md's per-step figures): both loops run, each verify forward is
    timed apart, and the patch that times it is undone."""
    from rift_ada.static import StaticVerify

    mod = script_module("plain_step_overhead")
    before = StaticVerify.__call__
    assert mod.main(["--input-tokens", "512", "--new-tokens", "6", "--repeats", "2", "--source-dir", "stdlib"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert StaticVerify.__call__ is before
    assert sorted(r["loop"] for r in out["rows"]) == ["decoder", "decoder", "plain", "plain"]
    for r in out["rows"]:
        assert 0 < r["forward_ms"] < r["ms_per_token"] and r["loop_ms"] > 0
    for bad in ("0", "1"):  # one token is the prefill's: no decode step to time
        with pytest.raises(SystemExit):
            mod.parse_args(["--new-tokens", bad])
