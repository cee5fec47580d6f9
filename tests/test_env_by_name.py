"""Environments made by name: each registered id makes a working environment with no arguments on the built-in
testbed, every knob is a plain keyword (``gymnasium.make``, ``gymnasium.make_vec``, SB3's ``make_vec_env``), the
checkers pass without a warning, the default tables are built once under a lock and reused, and a bad keyword fails
in one line naming it and what is accepted."""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import rift_ada.envs as envs
from rift_ada.envs import JointReplayEnv, RefreshEnv, ReplayEnv
from rift_ada.envs.settings import Setup
from rift_ada.joint import RoundCosts

ROOT = Path(__file__).resolve().parents[1]
IDS = (envs.ENV_ID, envs.REPLAY_ENV_ID, envs.JOINT_ENV_ID)
# Small settings of every build keyword, on the trained pair alone: what the tests that build their own tables or
# decoder use (the default set is built once per machine and shared with the tests of the defaults).
LIGHT = dict(target="testbed-lm", drafter="testbed-lm", prompts=2, task="low,sort", input_tokens=512,
             max_new_tokens=32, budget=64)


def same_tables(a, b) -> bool:
    return len(a) == len(b) and all(x.header == y.header and np.array_equal(x.tokens, y.tokens)
                                    and np.array_equal(x.q, y.q, equal_nan=True) for x, y in zip(a, b))


def no_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_id_runs_made_by_name_with_no_arguments_in_a_fresh_interpreter():
    """The issue's acceptance, as a new user runs it: a fresh interpreter makes each id with no arguments, resets it,
    takes 100 random steps and closes it (the first id by gymnasium's ``module:id`` form, before any import of ours),
    and ``make_vec`` makes 4 of each replay env; no warning anywhere."""
    script = textwrap.dedent("""
        import json, warnings
        import gymnasium as gym
        import numpy as np
        out = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for env_id in ("rift_ada.envs:rift_ada/Replay-v0", "rift_ada/JointReplay-v0", "rift_ada/Refresh-v0"):
                env = gym.make(env_id)
                obs, info = env.reset(seed=0)
                env.action_space.seed(0)
                inside = bool(env.observation_space.contains(obs))
                for _ in range(100):
                    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
                    inside &= bool(env.observation_space.contains(obs) and np.isfinite(reward))
                    if terminated or truncated:
                        obs, info = env.reset()
                env.close()
                out[env_id] = {"obs": len(obs), "actions": int(env.action_space.n), "inside": inside}
            for env_id in ("rift_ada/Replay-v0", "rift_ada/JointReplay-v0"):
                venv = gym.make_vec(env_id, num_envs=4)
                obs, _ = venv.reset(seed=0)
                for _ in range(10):
                    obs, rewards, terminations, truncations, infos = venv.step(venv.action_space.sample())
                venv.close()
                out[f"vec {env_id}"] = list(obs.shape)
        out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=840, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"rift_ada.envs:rift_ada/Replay-v0": {"obs": 15, "actions": 2, "inside": True},
                   "rift_ada/JointReplay-v0": {"obs": 24, "actions": 13, "inside": True},
                   "rift_ada/Refresh-v0": {"obs": 15, "actions": 2, "inside": True},
                   "vec rift_ada/Replay-v0": [4, 15], "vec rift_ada/JointReplay-v0": [4, 24], "warnings": []}


@pytest.mark.parametrize("env_id", IDS)
def test_checkers_pass_without_a_warning_on_each_id_made_by_name(env_id):
    """gymnasium's and SB3's checkers on each id made by name: the replay ids with no arguments; Refresh-v0 on the
    trained pair and short prompts (its checks reset a dozen times, each a prefill of both models: seconds each on
    the default pair; its spaces and API are the same)."""
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    kwargs = LIGHT if env_id == envs.ENV_ID else {}
    env = gym.make(env_id, **kwargs).unwrapped
    no_warnings(lambda: (gym_check(env), sb3_check(env)))
    assert np.isfinite(env.observation_space.low).all() and np.isfinite(env.observation_space.high).all()


def test_make_vec_and_sb3_make_vec_env_take_the_keywords():
    from stable_baselines3.common.env_util import make_vec_env

    venv = no_warnings(lambda: gym.make_vec(envs.ENV_ID, num_envs=4, **LIGHT))
    obs, _ = venv.reset(seed=0)
    obs, *_ = venv.step(np.array([1, 0, 1, 0]))
    assert obs.shape == (4, 15) and len({id(e.unwrapped.decoder.target) for e in venv.envs}) == 1, "models shared"
    venv.close()
    venv = make_vec_env(envs.REPLAY_ENV_ID, n_envs=4, seed=0, env_kwargs={"lam": 3.0, "draft_length": 5})
    assert {(e.unwrapped.lam, e.unwrapped.k) for e in venv.envs} == {(3.0, 5)}
    venv.reset()
    _, rewards, _, _ = venv.step(np.ones(4, dtype=int))
    assert rewards.shape == (4,) and (rewards <= 5 - 3.0 * 2.0).all(), "a refresh costs lam x refresh_cost"
    venv.close()


def test_a_seed_fixes_an_episode_of_each_env_made_by_name():
    def run(env_id, seed, **kw):
        env = gym.make(env_id, **kw)
        obs, _ = env.reset(seed=seed)
        out, rng = [obs], np.random.default_rng(0)
        for _ in range(30):
            obs, reward, terminated, *_ = env.step(int(rng.integers(env.action_space.n)))
            out.append(np.append(obs, reward))
            if terminated:
                break
        return np.concatenate(out)

    for env_id, kw in ((envs.REPLAY_ENV_ID, {}), (envs.JOINT_ENV_ID, {}), (envs.ENV_ID, LIGHT)):
        assert np.array_equal(run(env_id, 3, **kw), run(env_id, 3, **kw)), env_id
        assert not np.array_equal(run(env_id, 3, **kw), run(env_id, 4, **kw)), env_id


def test_the_defaults_are_one_setting_for_the_live_and_the_replay_envs():
    """Refresh-v0 decodes the prompts the default tables were built from, with the pair, cache and sampling they
    hold, so a policy trained on Replay-v0 by name meets the same decisions in Refresh-v0 by name."""
    from rift_ada.models import load_tokenizer
    from rift_ada.replay.table import fingerprint, layout_dict

    replay = gym.make(envs.REPLAY_ENV_ID).unwrapped
    setup = Setup()
    h = replay.tables[0].header
    assert len(replay.tables) == setup.prompts == 3 and replay.k == setup.draft_length
    assert (h["target_name"], h["draft_name"], h["temperature"], h["grid"], h["max_new_tokens"],
            h["layout"]["budget"]) == ("testbed", "testbed", 1.0, 8, 256, 256)
    ids = setup.prompt_ids(load_tokenizer("testbed"))
    assert [t.prompt.tolist() for t in replay.tables] == ids
    refresh = gym.make(envs.ENV_ID).unwrapped  # loads the pair and builds the prompts: no decoding yet
    assert refresh.prompts == ids and refresh.max_new_tokens == h["max_new_tokens"]
    for table in replay.tables:  # ValueError naming the first setting that differs
        table.check(layout=layout_dict(refresh.decoder.layout), temperature=refresh.decoder.temperature,
                    target=fingerprint(refresh.decoder.target), draft=fingerprint(refresh.decoder.draft))


def test_keywords_build_what_a_hand_built_env_is_given():
    """RefreshEnv by keywords steps exactly as one handed the decoder and prompts those keywords describe."""
    from rift_ada.data import build_task_mix, encode
    from rift_ada.models import load_pair
    from rift_ada.policies import make_policy
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    pair = load_pair("testbed-lm", "testbed-lm")
    ids = [encode(pair.tokenizer, t.prompt) for t in build_task_mix(pair.tokenizer, "low,sort", 2, 512, 0, "train")]
    layout = make_policy("rift-ada", 64, controller="never", refresh_grid=8).layout
    by_hand = RefreshEnv(SpeculativeDecoder.for_pair(pair, layout, Decoding(11, 1.0)), ids, 32)
    by_name = gym.make(envs.ENV_ID, **LIGHT).unwrapped
    assert by_name.prompts == by_hand.prompts
    for env in (by_hand, by_name):
        env.reset(seed=5, options={"prompt_index": 1})
    for a in (1, 0, 0, 1, 0):
        x, y = by_hand.step(a), by_name.step(a)
        assert np.array_equal(x[0], y[0]) and x[1:4] == y[1:4]
    strings = RefreshEnv(prompts=["def f(x):\n    return x\n" * 40], max_new_tokens=8, target="testbed-lm",
                         drafter="testbed-lm", budget=64)
    assert strings.prompts == [encode(pair.tokenizer, "def f(x):\n    return x\n" * 40)]


@pytest.mark.slow
def test_default_tables_are_built_once_under_a_lock_and_reused(tmp_path, monkeypatch, capsys):
    """Two processes asking for the same set at once (pytest workers, SubprocVecEnv workers): one builds it, the
    other waits and loads it; a later env loads it without building; other settings name another set."""
    script = ("import sys; from rift_ada.envs.settings import Setup; from rift_ada.envs.tables import built_tables; "
              f"t = built_tables(Setup.of('test', {LIGHT!r})); "
              "print(repr([x.tokens.tolist() for x in t]))")
    env = {**os.environ, "RIFT_ADA_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert outs[0][0] == outs[1][0], "both read the one set"
    assert sum(e.count("building the replay tables") for _, e in outs) == 1, "built once"
    (folder,) = tmp_path.glob("replay-tables-*")
    manifest = json.loads((folder / "tables.json").read_text())
    assert manifest["tables"] == ["table-000.safetensors", "table-001.safetensors"]
    monkeypatch.setenv("RIFT_ADA_CACHE", str(tmp_path))
    capsys.readouterr()
    env = ReplayEnv(**LIGHT)
    assert "building" not in capsys.readouterr().err and repr([t.tokens.tolist() for t in env.tables]) \
        == outs[0][0].strip()
    assert same_tables(ReplayEnv(tables=folder).tables, env.tables), "the folder is a tables folder like any other"
    from rift_ada.envs.tables import table_key

    assert table_key(Setup.of("t", LIGHT)) == folder.name.split("-")[-1]
    assert table_key(Setup.of("t", {**LIGHT, "seed": 1})) != table_key(Setup.of("t", LIGHT))
    assert table_key(Setup.of("t", {**LIGHT, "draft_length": 4})) == table_key(Setup.of("t", LIGHT)), \
        "a table replays at any k"


def test_joint_bounds_are_the_exact_range_of_the_cost_features():
    """Finite bounds where the gymnasium checker warned of infinite ones: each cost feature's least and greatest
    value over every context an episode can reach, including costs whose extended lines cross their floors."""
    odd = RoundCosts((100, 300, 900), (1, 2, 5), ((0.02, 0.03, 0.05), (0.01, 0.05, 0.02), (0.03, 0.02, 0.01)),
                     (0.004, 0.001, 0.006), (0.01, 0.0, 0.02), 64)
    shipped = RoundCosts.from_dict(json.loads((ROOT / "envs" / "testbed_round_costs.json").read_text())["costs"])
    for costs, k in ((odd, 4), (odd, 1), (shipped, 11)):
        lo, hi = costs.feature_range(k, 3000)
        every = np.asarray([costs.features(c, k) for c in range(1, 3001)], dtype=np.float32)
        assert np.array_equal(lo, every.min(0)) and np.array_equal(hi, every.max(0))
    env = gym.make(envs.JOINT_ENV_ID).unwrapped
    assert env.costs == shipped and np.isfinite(env.observation_space.high).all()
    longest = max(t.prompt_len + len(t.tokens) for t in env.tables)
    assert env.last_context == longest
    env.reset(seed=0, options={"context": 1})
    with pytest.raises(ValueError, match="options\\['context'\\] must keep the episode within"):
        env.reset(seed=0, options={"context": longest})


def test_tables_and_costs_come_as_objects_files_or_folders(tmp_path):
    from rift_ada.costs import CostModel

    tables = gym.make(envs.REPLAY_ENV_ID).unwrapped.tables
    paths = [t.path for t in tables]
    assert same_tables(ReplayEnv(tables=paths).tables, tables)
    assert same_tables(ReplayEnv(tables=Path(paths[0]).parent).tables, tables)
    assert ReplayEnv(tables=tables).tables[0] is tables[0], "objects, as trainers pass them"
    shipped = JointReplayEnv().costs
    (tmp_path / "joint.json").write_text(json.dumps({"costs": shipped.to_dict(), "chosen": "gain"}))
    assert JointReplayEnv(costs=str(tmp_path / "joint.json")).costs == shipped
    assert JointReplayEnv(tables, shipped, (0, 4)).action_space.n == 3, "the positional form, as trainers call it"
    model = CostModel(0.004, 0.012, 0.02)
    (tmp_path / "costs.json").write_text(json.dumps(model.to_dict()))
    env = gym.make(envs.REPLAY_ENV_ID, reward="time", costs=str(tmp_path / "costs.json")).unwrapped
    assert env.costs == model and env.reward_kind == "time"


EMPTY = "an empty folder"


@pytest.mark.parametrize("env_id, kwargs, error, words", [
    (envs.REPLAY_ENV_ID, {"budjet": 128}, TypeError, ["'budjet'", "did you mean 'budget'", "it accepts: tables,",
                                                      "draft_length", "source_dir", "temperature"]),
    (envs.ENV_ID, {"tables": "x"}, TypeError, ["'tables'", "it accepts: decoder, prompts, max_new_tokens"]),
    (envs.JOINT_ENV_ID, {"lam": 2.0}, TypeError, ["'lam'", "it accepts: tables, costs, draft_lengths"]),
    (envs.REPLAY_ENV_ID, {"budget": 0}, ValueError, ["budget must be an integer >= 1, got 0"]),
    (envs.REPLAY_ENV_ID, {"input_tokens": 1.5}, ValueError, ["input_tokens must be an integer >= 1"]),
    (envs.ENV_ID, {"temperature": -1}, ValueError, ["temperature must be a number >= 0"]),
    (envs.REPLAY_ENV_ID, {"prompts": 0}, ValueError, ["prompts must be a number of prompts to build"]),
    (envs.REPLAY_ENV_ID, {"prompts": ["a", [1, 2]]}, ValueError, ["prompts must be", "not mixed"]),
    (envs.REPLAY_ENV_ID, {"prompts": ["def f(): pass"], "task": "low"}, ValueError, ["task only shapes built prompts"]),
    (envs.REPLAY_ENV_ID, {"task": "lowish"}, ValueError, ["task must be one of low, mixed, high, sort"]),
    (envs.REPLAY_ENV_ID, {"source_dir": "/no/such/code"}, ValueError, ["source_dir: code base '/no/such/code'"]),
    (envs.REPLAY_ENV_ID, {"target": "no-such-model"}, ValueError, ["ReplayEnv: target: unknown model name"]),
    (envs.ENV_ID, {"target": "testbed-lm", "drafter": "no-such-model"}, ValueError, ["RefreshEnv: drafter: unknown model name"]),
    (envs.REPLAY_ENV_ID, {"dtype": "int8"}, ValueError, ["dtype: unsupported dtype 'int8'"]),
    (envs.REPLAY_ENV_ID, {"tables": "/no/such/tables"}, ValueError, ["tables: /no/such/tables: no such replay table"]),
    (envs.REPLAY_ENV_ID, {"tables": EMPTY}, ValueError, ["tables: no replay tables (*.safetensors) in"]),
    (envs.REPLAY_ENV_ID, {"tables": 3}, TypeError, ["tables must be replay tables, table files, or a folder"]),
    (envs.REPLAY_ENV_ID, {"tables": EMPTY, "budget": 64}, ValueError, ["budget only sets how the tables it builds"]),
    (envs.REPLAY_ENV_ID, {"reward": "time"}, ValueError, ["reward='time' needs costs=CostModel(...) or a JSON file"]),
    (envs.REPLAY_ENV_ID, {"reward": "time", "costs": "/no/costs.json"}, ValueError,
     ["costs: no such file '/no/costs.json'"]),
    (envs.REPLAY_ENV_ID, {"reward": "time", "costs": {"verify_s": 1}}, ValueError,
     ["costs: the dict given is not a CostModel (draft_step_s, verify_s, refresh_s"]),
    (envs.JOINT_ENV_ID, {"costs": 3}, TypeError, ["costs must be a RoundCosts, a dict of one or a JSON file"]),
    (envs.JOINT_ENV_ID, {"costs": {"lengths": [1]}}, ValueError, ["costs: the dict given: not a round-cost model"]),
    (envs.ENV_ID, {"budget": 64, "decoder": "given"}, ValueError, ["budget only builds the decoder or the prompts"]),
])
def test_bad_keywords_fail_in_one_line_naming_the_keyword(env_id, kwargs, error, words, tmp_path, monkeypatch):
    """Refused before anything is loaded or built (seconds), in one line that names the keyword and what it takes."""
    monkeypatch.setenv("RIFT_ADA_CACHE", str(tmp_path / "cache"))  # nothing of a refused env lands in the user's
    kwargs = {k: str(tmp_path) if v == EMPTY else v for k, v in kwargs.items()}
    if kwargs.get("decoder") == "given":
        from tests.conftest import env_kw

        kwargs["decoder"] = env_kw()["decoder"]
    with pytest.raises(error) as caught:
        gym.make(env_id, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("replay-tables-*"))


def test_a_budget_the_prompts_cannot_exceed_is_refused_before_any_table_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("RIFT_ADA_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"^ReplayEnv: budget: a replay table needs a prompt longer than the budget"):
        ReplayEnv(**{**LIGHT, "budget": 4096})
    assert not list(tmp_path.glob("replay-tables-*/*.safetensors"))
    with pytest.raises(ValueError, match="RefreshEnv: with a decoder, give prompts as token ids"):
        from tests.conftest import env_kw

        RefreshEnv(env_kw()["decoder"], ["some text"])


def test_the_readme_example_trains_sb3_ppo_and_steps_a_plain_loop_by_name():
    """The README's example runs as written, shortened: SB3 PPO on Replay-v0 made by name (one rollout), then the
    CleanRL-style loop over ``gymnasium.make_vec``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if 'make_vec_env("rift_ada/Replay-v0"' in b]
    short = re.sub(r"learn\(total_timesteps=[\d_]+\)", "learn(total_timesteps=2048)", block)
    short = re.sub(r"range\([\d_]+\)", "range(300)", short)
    assert short.count("2048") == 1 and short.count("range(300)") == 1
    scope = {}
    no_warnings(lambda: exec(compile(short, "README.md", "exec"), scope))
    assert scope["model"].num_timesteps >= 2048 and scope["obs"].shape == (8, 15)
    assert scope["venv"].envs[0].unwrapped.lam == 2.0
