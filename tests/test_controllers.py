import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rift_ada import signals
from rift_ada.controllers import fit_logistic
from rift_ada.envs import RefreshEnv
from rift_ada.controllers import DQNController, PPOController
from rift_ada.refresh import (EntropyController, NeverController, PeriodicController, ThresholdController,
                              load_controller, parse_controller)
from rift_ada.speculative import Decoding
from tests.conftest import env_kw


def ENV_KW():  # a fresh decoder per environment
    return env_kw(budget=128, input_tokens=1024, prompts=3, max_new_tokens=48)


def obs_with(**values):
    x = np.full(len(signals.NAMES), 0.5, dtype=np.float32)
    for k, v in values.items():
        x[signals.index(k)] = v
    return x


def box_samples(n, seed=0):
    return np.random.default_rng(seed).uniform(signals.LOW, signals.HIGH, (n, len(signals.NAMES))).astype(np.float32)


def test_rule_controllers_and_roundtrip(tmp_path):
    tok = 1 / signals.SINCE_SCALE
    assert not NeverController().decide(obs_with())
    p = PeriodicController(64)
    assert not p.decide(obs_with(since_refresh=63 * tok)) and p.decide(obs_with(since_refresh=64 * tok))
    t = ThresholdController([("acc_mean", "<", 0.4), ("drift", ">", 0.3)], min_gap=16)
    assert t.decide(obs_with(acc_mean=0.2, since_refresh=20 * tok))
    assert t.decide(obs_with(drift=0.5, since_refresh=20 * tok))
    assert not t.decide(obs_with(acc_mean=0.2, since_refresh=8 * tok)), "min_gap holds back early refreshes"
    for c in (NeverController(), p, t):
        c.save(tmp_path / f"{c.kind}.json")
        back = load_controller(tmp_path / f"{c.kind}.json")
        xs = box_samples(500)
        assert [back.decide(x) for x in xs] == [c.decide(x) for x in xs]
    with pytest.raises(ValueError, match="unknown signal"):
        ThresholdController([("entropy", ">", 1)])
    with pytest.raises(ValueError, match="signals"):
        p.decide(np.zeros(3))
    assert parse_controller("periodic:64") == p and isinstance(parse_controller("never"), NeverController)
    assert parse_controller(str(tmp_path / "threshold.json")) == t
    with pytest.raises(ValueError, match="between 1 and 4096"):
        PeriodicController(5000)  # beyond the since_refresh signal's range: it could never fire


def test_entropy_rule(tmp_path):
    tok = 1 / signals.SINCE_SCALE
    e = EntropyController(0.25)  # min_gap 16, as the threshold rule
    assert e.decide(obs_with(entropy_mean=0.26, since_refresh=20 * tok))
    assert not e.decide(obs_with(entropy_mean=0.25, since_refresh=20 * tok)), "strictly above the threshold"
    assert not e.decide(obs_with(entropy_mean=0.9, since_refresh=8 * tok)), "min_gap holds back early refreshes"
    assert not e.decide(obs_with(entropy_mean=0.1, entropy_max=0.9, since_refresh=20 * tok)), "the mean, not the max"
    xs = box_samples(2000, seed=3)
    same = ThresholdController([("entropy_mean", ">", 0.25)], min_gap=16)
    assert [e.decide(x) for x in xs] == [same.decide(x) for x in xs]
    e.save(tmp_path / "e.json")
    assert load_controller(tmp_path / "e.json") == e
    assert parse_controller("entropy:0.25") == e and parse_controller(str(tmp_path / "e.json")) == e
    for bad in ("entropy:x", "entropy:", "entropy:2.5", "entropy:nan"):
        with pytest.raises(ValueError, match=r"write entropy:X with X in \[0, 1\]") as err:
            parse_controller(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not in nats"):
        parse_controller("entropy:2.5")


@pytest.fixture(scope="module")
def labelled_states():
    """Replayed states of two training prompts (self-speculation on the trained pair, budget 128 of 1K, grid 4) and
    the oracle's decisions there (rift_ada.trainers.oracle_labels)."""
    from dataclasses import replace

    from rift_ada.replay.build import build_table
    from rift_ada.replay.oracle import solve
    from rift_ada.trainers.oracle_labels import RandomPeriods, label_states

    env = RefreshEnv(**ENV_KW())
    dec = env.decoder
    layout = replace(dec.layout, refresh_grid=4)
    tables = [build_table(dec.target, dec.draft, p, layout, Decoding(), 64) for p in env.prompts[:2]]
    schedules = [solve(t, 11, 0.5) for t in tables]
    return label_states(tables, schedules, 11, lambda g: RandomPeriods((8, 32), g), 2, np.random.default_rng(0))


def test_logistic_export_parity(labelled_states, tmp_path):
    data = labelled_states
    assert len(data.X) >= 10 and data.X.shape[1] == len(signals.NAMES)
    y = data.y
    if len(np.unique(y)) < 2:  # make both classes present (a real, if arbitrary, split of the real states)
        y = (data.X[:, signals.index("since_refresh")] > np.median(data.X[:, signals.index("since_refresh")])).astype(int)
    ctrl = fit_logistic(data.X, y, threshold=0.4)
    xs = np.concatenate([box_samples(10_000), data.X])
    p_sk = ctrl.sklearn_model.predict_proba(xs)[:, 1]
    ours = np.array([ctrl.probability(x) for x in xs])
    np.testing.assert_allclose(ours, p_sk, atol=1e-6)  # sklearn keeps float32 inputs in float32
    ctrl.save(tmp_path / "c.json")
    back = load_controller(tmp_path / "c.json")
    assert np.array_equal([back.decide(x) for x in xs], p_sk > 0.4)
    assert json.loads((tmp_path / "c.json").read_text())["signals"] == list(signals.NAMES)


@pytest.fixture(scope="module")
def trained_ppo():
    from rift_ada.controllers import export_ppo
    from rift_ada.trainers.ppo import train_ppo

    # Refreshing is free (lam 0): a policy that learned anything refreshes where it helps.
    env_fns = [lambda: RefreshEnv(lam=0.0, **ENV_KW())]
    model, venv = train_ppo(env_fns, timesteps=768, seed=0, n_steps=128, learning_rate=1e-3)
    return model, venv, export_ppo(model, venv, lam=0.0)


@pytest.mark.slow
def test_ppo_export_parity(trained_ppo, tmp_path):
    model, venv, ctrl = trained_ppo
    xs = box_samples(10_000, seed=1)
    expected = model.predict(venv.normalize_obs(xs), deterministic=True)[0]
    assert np.array_equal(ctrl.decide_batch(xs), expected)
    ctrl.save(tmp_path / "c.pt")
    back = load_controller(tmp_path / "c.pt")
    assert isinstance(back, PPOController)
    assert np.array_equal(back.decide_batch(xs), expected)


@pytest.fixture(scope="module")
def trained_dqn():
    from rift_ada.controllers import export_dqn
    from rift_ada.trainers.dqn import train_dqn

    env_fns = [lambda: RefreshEnv(lam=0.0, **ENV_KW())]
    model, venv = train_dqn(env_fns, timesteps=256, seed=0, learning_starts=64)
    return model, venv, export_dqn(model, venv, lam=0.0)


@pytest.mark.slow
def test_dqn_export_parity(trained_dqn, tmp_path):
    model, venv, ctrl = trained_dqn
    assert model.num_timesteps >= 256 and model._n_updates > 0, "the Q-network was trained"
    xs = box_samples(10_000, seed=2)
    expected = model.predict(venv.normalize_obs(xs), deterministic=True)[0]
    assert np.array_equal(ctrl.decide_batch(xs), expected)
    assert [ctrl.decide(x) for x in xs[:200]] == [bool(a) for a in expected[:200]]
    ctrl.save(tmp_path / "d.pt")
    back = load_controller(tmp_path / "d.pt")
    assert isinstance(back, DQNController) and back.kind == "dqn" and back.lam == 0.0
    assert np.array_equal(back.decide_batch(xs), expected)
    assert DQNController.load(tmp_path / "d.pt").sizes == ctrl.sizes
    with pytest.raises(ValueError, match="not a PPO controller file .*kind 'dqn'"):
        PPOController.load(tmp_path / "d.pt")


def episode_reward(env, controller, seed, prompt):
    obs, _ = env.reset(seed=seed, options={"prompt_index": prompt})
    total, done = 0.0, False
    while not done:
        obs, r, term, trunc, _ = env.step(int(controller.decide(obs)))
        total += r
        done = term or trunc
    return total


class AlwaysRefresh:
    def decide(self, observation):
        return True


def test_ppo_learned_when_refreshing_pays(trained_ppo):
    _, _, ctrl = trained_ppo
    # At zero cost refreshing every round is the most a controller can accept: PPO must match it (within 1 token
    # per prompt; refreshing at random half the time falls 5 tokens short here, never-refreshing 45).
    free = RefreshEnv(lam=0.0, **ENV_KW())
    ppo, always = (sum(episode_reward(free, c, 0, i) for i in range(3)) for c in (ctrl, AlwaysRefresh()))
    assert ppo >= always - 3, (ppo, always)
    # At a positive cost (lam 1: 2 tokens per refresh) its refreshes must still pay for themselves.
    costly = RefreshEnv(lam=1.0, **ENV_KW())
    ppo, never = (sum(episode_reward(costly, c, 0, i) for i in range(3)) for c in (ctrl, NeverController()))
    assert ppo > never, (ppo, never)


def poisoned_path(tmp_path):
    """A folder whose sklearn and stable_baselines3 raise on import: as if they were not installed."""
    root = tmp_path / "poisoned"
    for name in ("sklearn", "stable_baselines3"):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text(f"raise ImportError('{name} is not available at inference')\n")
    return str(root)


# Runs rift_ada.evaluate's CLI in a fresh process, recording what its evaluate() returns: every round's record.
DRIVE = """
import dataclasses, json, sys
import rift_ada.evaluate as E
own, runs = E.evaluate, []
def recording(decoder, *args, **kwargs):
    runs.append((decoder.draft.config.vocab_size, own(decoder, *args, **kwargs)))
    return runs[-1][1]
E.evaluate = recording
assert E.main(['--target', 'testbed-lm', '--policy', 'rift-ada', '--controller', sys.argv[1], '--budget', '128',
               '--prompts', '1', '--input-tokens', '1024', '--max-new-tokens', str(MAX_NEW), '--json']) == 0
assert 'sklearn' not in sys.modules and 'stable_baselines3' not in sys.modules
vocab, ev = runs[0]
print(json.dumps({'vocab': vocab, 'rounds': [dataclasses.asdict(r) for r in ev.results[0].rounds]}))
"""
MAX_NEW = 32


def replayed_decisions(controller, rounds: list[dict], max_new_tokens: int, vocab: int) -> list[bool]:
    """The controller's decision before each round, on the observation rebuilt from the records: the state the
    decoder published then (rift_ada.signals.DecoderState) is a function of the rounds before it and of the
    round's own recorded position, tokens since refresh, drift, runway and focus."""
    from rift_ada.signals import DecoderState

    decisions = []
    for i, r in enumerate(rounds):
        past = rounds[:i]
        # the last scoring: the prefill, or the last round that refreshed; its fresh rounds start there, and the drift
        # published right after it is the next record's
        last = max([j for j, p in enumerate(past) if p["refreshed"]], default=-1)
        fresh = past[max(last, 0):][:signals.FRESH]
        state = DecoderState(
            generated=r["position"], max_new_tokens=max_new_tokens, rounds=i,
            tokens_since_refresh=r["tokens_since_refresh"], drift=r["drift"], runway=r["runway"], focus=r["focus"],
            acceptance=tuple(p["accepted"] / p["draft_length"] for p in past[::-1][:signals.HISTORY]),
            entropy_mean=past[-1]["entropy_mean"] if past else 0.0,
            entropy_max=past[-1]["entropy_max"] if past else 0.0, vocab_size=vocab,
            fresh=tuple(p["accepted"] / p["draft_length"] for p in fresh), drift_floor=rounds[last + 1]["drift"])
        decisions.append(bool(controller.decide(signals.observe(state))))
    return decisions


def test_exported_controller_drives_decoding_without_training_libraries(trained_ppo, trained_dqn, labelled_states,
                                                                       tmp_path):
    """Each exported controller (PPO, DQN, logistic) drives `python -m rift_ada.evaluate --policy rift-ada` with
    scikit-learn and stable-baselines3 unimportable, and what decoding did is what the controller decides: the
    rounds that refreshed are exactly those where the controller, loaded here and given each round's observation
    rebuilt from the records, says refresh (a controller that was ignored, or given other signals, fails). The
    logistic controller is fit to refresh late in generation (position above its median), so it says both no and
    yes within the 32 tokens."""
    _, _, ppo = trained_ppo
    ppo.save(tmp_path / "c.pt")
    trained_dqn[2].save(tmp_path / "d.pt")
    position = labelled_states.X[:, signals.index("position")]
    fit_logistic(labelled_states.X, (position > np.median(position)).astype(int)).save(tmp_path / "c.json")
    for f in ("c.pt", "d.pt", "c.json"):
        out = subprocess.run([sys.executable, "-c", DRIVE.replace("MAX_NEW", str(MAX_NEW)), str(tmp_path / f)],
                             capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=poisoned_path(tmp_path)))
        assert out.returncode == 0, out.stderr[-2000:]
        *_, summary, recorded = out.stdout.strip().splitlines()
        res, recorded = json.loads(summary), json.loads(recorded)
        assert res["policy"] == "rift-ada" and res["target_greedy_match"] == 1.0
        rounds = recorded["rounds"]
        decided = replayed_decisions(load_controller(tmp_path / f), rounds, MAX_NEW, recorded["vocab"])
        assert [r["refreshed"] for r in rounds] == decided, f
        assert res["refreshes"] == sum(decided)
        if f == "c.json":
            assert 0 < sum(decided) < len(decided), decided


def test_learning_curve_scores_growing_fits_on_held_out_states():
    from rift_ada.controllers import learning_curve

    rng = np.random.default_rng(0)
    X = rng.uniform(0, 1, (400, len(signals.NAMES)))
    y = (X[:, 0] + 0.1 * rng.standard_normal(400) > 0.5).astype(int)
    curve = learning_curve(X, y, seed=0)
    assert [c["train_states"] for c in curve] == [38, 75, 150, 300]
    assert curve[-1]["accuracy"] > 0.85 and curve[-1]["log_loss"] < curve[0]["log_loss"]
    assert learning_curve(X, np.zeros(400, dtype=int)) == [], "one class held out: no curve"


def test_tree_export_parity_roundtrip_and_damaged_files(tmp_path):
    """The exported tree decides as scikit-learn's predict_proba does (10,000 observations), loads back equal,
    without scikit-learn, and a damaged file is refused in one line naming it."""
    from rift_ada.controllers import fit_tree
    from rift_ada.controllers import TreeController

    rng = np.random.default_rng(1)
    X = box_samples(600, seed=2)
    r, f = X[:, signals.index("runway")], X[:, signals.index("focus")]
    y = (((r < 0.2) & (f > 0.5)) | (X[:, signals.index("acc_mean")] < 0.1)).astype(int) ^ (rng.random(600) < 0.05)
    tree = fit_tree(X, y, max_depth=3, decision=0.4)
    xs = box_samples(10_000, seed=3)
    p_sk = tree.sklearn_model.predict_proba(xs)[:, 1]
    np.testing.assert_allclose([tree.probability(x) for x in xs], p_sk, atol=1e-12)
    assert {signals.NAMES[i] for i in tree.feature if i >= 0} >= {"runway", "focus"}, tree.describe()
    tree.save(tmp_path / "t.json")
    back = load_controller(tmp_path / "t.json")
    assert isinstance(back, TreeController) and back == tree
    assert np.array_equal([back.decide(x) for x in xs], p_sk > 0.4)
    good = json.loads((tmp_path / "t.json").read_text())
    for name, change in {"cycle": {"left": [0] * len(good["left"])},
                         "short": {"value": good["value"][:-1]},
                         "feature": {"feature": [99] * len(good["feature"])},
                         "decision": {"decision": 1.5}}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ValueError) as err:
            load_controller(tmp_path / f"{name}.json")
        assert f"{name}.json" in str(err.value) and "\n" not in str(err.value)
