import warnings

import gymnasium as gym
import numpy as np
import pytest

import rift_ada.envs as envs
from rift_ada.costs import CostModel, measure_costs
from rift_ada.envs import RefreshEnv
from rift_ada import signals
from tests.conftest import env_kw

MAX_NEW = 40
COSTS = CostModel(draft_step_s=0.004, verify_s=0.012, refresh_s=0.02)  # fixed: tests stay deterministic


@pytest.fixture(scope="module")
def env():
    return RefreshEnv(**env_kw(max_new_tokens=MAX_NEW))


@pytest.mark.parametrize("reward", ["tokens", "time"])
def test_checkers_pass_without_warnings(reward):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    kw = env_kw(max_new_tokens=MAX_NEW) | ({"reward": "time", "costs": COSTS} if reward == "time" else {})
    env = gym.make(envs.ENV_ID, **kw).unwrapped  # made through the registry, so it has a spec
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check(env)
        sb3_check(env)


def test_registered_and_spaces():
    e = gym.make(envs.ENV_ID, **env_kw(max_new_tokens=MAX_NEW))
    obs, info = e.reset(seed=0)
    assert e.observation_space.contains(obs) and obs.shape == (len(signals.NAMES),)
    assert e.action_space == gym.spaces.Discrete(2)
    obs, r, term, trunc, info = e.step(1)
    assert info["refreshed"] and info["refreshes"] == 1 and isinstance(r, float)
    assert set(info) >= {"accepted", "refreshed", "acceptance_length", "refreshes"}
    e.close()


def rollout(env, seed, actions):
    obs, _ = env.reset(seed=seed)
    traj = [obs]
    rewards = []
    for i in range(1000):
        obs, r, term, trunc, info = env.step(actions(i))
        traj.append(obs)
        rewards.append(r)
        if term or trunc:
            return np.array(traj), rewards, info


def test_same_seed_same_trajectory(env):
    act = lambda i: int(i % 3 == 0)  # noqa: E731
    a, ra, ia = rollout(env, 5, act)
    b, rb, ib = rollout(env, 5, act)
    assert np.array_equal(a, b) and ra == rb and ia == ib
    assert ia["generated_tokens"] == MAX_NEW


def test_reward_charges_refreshes():
    env = RefreshEnv(lam=2.0, refresh_cost=3.0, **env_kw(max_new_tokens=MAX_NEW))
    env.reset(seed=0, options={"prompt_index": 1})
    _, r, *_, info = env.step(1)
    assert r == info["accepted"] - 6.0 and env.prompt_index == 1
    with pytest.raises(ValueError, match="action must be"):
        env.step(2)
    with pytest.raises(ValueError, match="out of range"):
        env.reset(options={"prompt_index": 7})


def test_refuses_a_decoder_that_cannot_refresh():
    from rift_ada.layout import CacheLayout

    kw = env_kw()
    kw["decoder"].layout = CacheLayout("rift", 128, store=False)
    with pytest.raises(ValueError, match="cannot refresh"):
        RefreshEnv(**kw)


def test_measured_costs_are_the_rounds_medians():
    """The cost model is the medians of the measured rounds' phase times (rift_ada.costs): a draft step is a round's
    draft time per drafted token, verify includes the rollback, and a refresh is timed on the rounds that refreshed
    (every other one here) only."""
    from statistics import median

    kw = env_kw()
    costs = measure_costs(kw["decoder"], kw["prompts"][0], max_new_tokens=96)
    rounds = kw["decoder"].result.rounds  # the decode it measured
    assert [r.refreshed for r in rounds] == [i % 2 == 0 for i in range(len(rounds))] and len(rounds) >= 6
    assert costs.draft_step_s == median(r.draft_seconds / r.draft_length for r in rounds if r.draft_length)
    assert costs.verify_s == median(r.verify_seconds + r.rollback_seconds for r in rounds)
    assert costs.refresh_s == median(r.refresh_seconds for r in rounds[::2])
    assert CostModel.from_dict(costs.to_dict()) == costs
    with pytest.raises(ValueError, match="raise max_new_tokens"):
        measure_costs(kw["decoder"], kw["prompts"][0], max_new_tokens=4)
    with pytest.raises(ValueError, match="verify_s must be > 0"):
        CostModel(0.1, 0.0, 0.1)


def test_time_reward_charges_the_refresh_time():
    def first_step(lam, action):
        env = RefreshEnv(reward="time", costs=COSTS, lam=lam, **env_kw(max_new_tokens=MAX_NEW))
        env.reset(seed=0, options={"prompt_index": 0})
        return env.step(action)

    _, charged, *_, info = first_step(1.0, 1)
    _, free, *_, info_free = first_step(0.0, 1)  # the same round (same seed and action), its refresh time not charged
    assert info["accepted"] == info_free["accepted"] and info["refreshed"]
    plain = 11 * COSTS.draft_step_s + COSTS.verify_s  # one round of k = 11 drafts without refresh: the time unit
    assert charged < free and charged == pytest.approx(free - COSTS.refresh_s / plain)
    assert free == pytest.approx(info["accepted"])  # a full-k round earns its accepted drafts, as the tokens reward
    assert info["modelled_seconds"] == pytest.approx(plain + COSTS.refresh_s)
    _, kept, *_, info_kept = first_step(1.0, 0)
    assert kept == pytest.approx(info_kept["accepted"]) and not info_kept["refreshed"]
    with pytest.raises(ValueError, match="needs costs=CostModel"):
        RefreshEnv(reward="time", **env_kw())
    with pytest.raises(ValueError, match="reward must be one of tokens, time"):
        RefreshEnv(reward="seconds", **env_kw())


def _step_all(venv, n_steps: int):
    """Obs, rewards and dones of ``n_steps`` vector steps, refreshing every 3rd round of each env."""
    venv.seed(7)
    out = [venv.reset()]
    rounds = np.zeros(venv.num_envs, dtype=int)
    for _ in range(n_steps):
        obs, rew, done, _ = venv.step((rounds % 3 == 0).astype(int))
        rounds = np.where(done, 0, rounds + 1)
        out += [obs, rew, done]
    venv.close()
    return out


@pytest.mark.slow
def test_subprocess_envs_step_like_one_process():
    """Two RefreshEnvSpec envs in worker processes (each loads its own testbed pair) give the same observations,
    rewards and episode ends as the same specs stepped in this process, episode boundaries included."""
    from rift_ada.envs.vec import RefreshEnvSpec, make_vec_env
    from rift_ada.layout import CacheLayout
    from tests.conftest import train_prompts

    prompts = tuple(tuple(p) for p in train_prompts(2, 1024))
    specs = [RefreshEnvSpec(prompts, CacheLayout("rift", 128), target="testbed-lm", drafter="testbed-lm", seed=i, max_new_tokens=24,
                            reward="time", costs=COSTS) for i in range(2)]
    one = _step_all(make_vec_env(specs), 12)  # 24 tokens: episodes end within 12 rounds, and restart
    sub = _step_all(make_vec_env(specs, subproc=True), 12)
    assert any(d.any() for d in one[3::3]), "no episode ended: the check would not cover resets"
    for a, b in zip(one, sub):  # DummyVecEnv keeps rewards in float32, SubprocVecEnv in float64
        np.testing.assert_array_equal(np.asarray(a, a.dtype), np.asarray(b, a.dtype))


def test_subprocess_envs_need_specs():
    from rift_ada.envs.vec import make_vec_env

    with pytest.raises(ValueError, match="RefreshEnvSpec"):
        make_vec_env([lambda: RefreshEnv(**env_kw(max_new_tokens=MAX_NEW))], subproc=True)
    with pytest.raises(ValueError, match="at least one"):
        make_vec_env([])
