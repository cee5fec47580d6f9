"""Bad input gets one clear line (library: one ValueError / ModelLoadError line; CLI: one stderr line, exit 2).

Real files throughout: the testbed models, controllers and adapters saved by the project's own code, then damaged.
"""

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rift_ada.controllers import DQNController, LogisticController, PPOController
from rift_ada.refresh import load_controller
from rift_ada.refresh.mlp import build_mlp
from rift_ada import lora, signals
from rift_ada.cli import add_runtime_options, apply_runtime
from rift_ada.data import load_jsonl, load_speedbench
from rift_ada.models import ModelLoadError, load_model
from rift_ada.testbed.composed import ASSETS as TESTBED_DIR

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
N = len(signals.NAMES)
FAST = ["--prompts", "1", "--max-new-tokens", "8", "--input-tokens", "1024"]


def one_line(err: BaseException, *phrases) -> str:
    msg = str(err)
    assert "\n" not in msg and "weights_only=False" not in msg, msg
    for p in phrases:
        assert p in msg, (p, msg)
    return msg


def run_cli(*argv, script=None):
    cmd = [sys.executable, str(ROOT / script)] if script else [sys.executable, "-m", "rift_ada.evaluate"]
    return subprocess.run([*cmd, *argv], env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)


def assert_one_line_exit_2(out, *phrases):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for p in phrases:
        assert p in lines[0], (p, lines[0])


# --- controllers ------------------------------------------------------------------------------------------------

def ppo_controller(**kw):
    return PPOController(build_mlp([N, 8, 2], "tanh"), [N, 8, 2], **kw)


@pytest.fixture(scope="module")
def bad_controllers(tmp_path_factory):
    """name -> (file, phrase its error must hold). Damaged copies of files PPOController / LogisticController wrote."""
    d = tmp_path_factory.mktemp("controllers")
    ppo_controller().save(d / "good.pt")
    good = (d / "good.pt").read_bytes()
    files = {"random.pt": (os.urandom(4096), "not a torch zip archive"), "empty.pt": (b"", "empty"),
             "truncated.pt": (good[: len(good) // 2], "not a torch zip archive")}
    for name, (data, _) in files.items():
        (d / name).write_bytes(data)
    cases = {name: (d / name, phrase) for name, (_, phrase) in files.items()}

    def saved(name, phrase, edit):
        obj = torch.load(d / "good.pt", weights_only=True)
        obj = edit(obj) or obj
        torch.save(obj, d / name)
        cases[name] = (d / name, phrase)

    saved("list.pt", "it holds a list", lambda o: [1, 2, 3])
    saved("logistic_kind.pt", "kind 'logistic'", lambda o: o.update(kind="logistic"))
    saved("shape.pt", f"'0.weight' has shape (4, {N})", lambda o: o["state_dict"].update({"0.weight": torch.zeros(4, N)}))
    saved("sizes.pt", "'sizes'", lambda o: o.update(sizes=[N, 8, 3]))
    saved("obs_mean.pt", "'obs_mean'", lambda o: o.update(obs_mean=[0.0, 1.0]))
    saved("code.pt", "refused", lambda o: o.update(payload=RunsCode(str(d / "executed"))))
    DQNController(build_mlp([N, 8, 2], "relu"), [N, 8, 2], "relu").save(d / "good_dqn.pt")
    good_dqn = (d / "good_dqn.pt").read_bytes()
    (d / "truncated_dqn.pt").write_bytes(good_dqn[: len(good_dqn) // 2])
    cases["truncated_dqn.pt"] = (d / "truncated_dqn.pt", "not a torch zip archive")
    dqn = torch.load(d / "good_dqn.pt", weights_only=True)
    for name, phrase, edit in [("dqn_shape.pt", "'2.bias' has shape (3,)", {"2.bias": torch.zeros(3)}),
                               ("dqn_nan.pt", "non-finite", {"0.bias": torch.full((8,), float("nan"))})]:
        torch.save({**dqn, "state_dict": {**dqn["state_dict"], **edit}}, d / name)
        cases[name] = (d / name, phrase)
    torch.save({**dqn, "kind": "a2c"}, d / "a2c_kind.pt")
    cases["a2c_kind.pt"] = (d / "a2c_kind.pt", "kind 'a2c'; expected a dict with kind 'ppo' or 'dqn'")

    LogisticController(weights=np.linspace(-1, 1, N), bias=0.5).save(d / "good.json")
    good_json = json.loads((d / "good.json").read_text())
    texts = {"list.json": ("[1, 2]", "holds a JSON list"), "not_json.json": ("{kind: logistic", "not valid JSON"),
             "binary.json": (None, "not UTF-8"),
             "unknown_kind.json": (json.dumps({**good_json, "kind": "svm"}), "unknown controller kind 'svm'"),
             "no_kind.json": ("{}", "no 'kind' field"),
             "no_weights.json": (json.dumps({k: v for k, v in good_json.items() if k != "weights"}),
                                 "missing field 'weights'"),
             "short_weights.json": (json.dumps({**good_json, "weights": [1.0, 2.0]}), f"list of {N} finite numbers"),
             "string_weights.json": (json.dumps({**good_json, "weights": ["0.1"] * N}), "'weights'"),
             "string_bias.json": (json.dumps({**good_json, "bias": "0.5"}), "'bias' must be a finite number"),
             "period_zero.json": (json.dumps({"kind": "periodic", "signals": list(signals.NAMES), "period": 0}),
                                  "'period' must be in [1, 4096]"),
             "entropy_nats.json": (json.dumps({"kind": "entropy", "signals": list(signals.NAMES), "threshold": 2.5}),
                                   "'threshold' must be in [0, 1]")}
    for name, (text, phrase) in texts.items():
        if text is None:
            (d / name).write_bytes(b"\xff\xfe\x00\x81 binary")
        else:
            (d / name).write_text(text)
        cases[name] = (d / name, phrase)
    return d, cases


class RunsCode:
    """Unpickling this creates a folder: a weights-only load must refuse it before that happens."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_every_damaged_controller_file_is_one_line(bad_controllers):
    d, cases = bad_controllers
    for name, (path, phrase) in cases.items():
        with pytest.raises(ValueError) as e:
            load_controller(path)
        one_line(e.value, str(path), phrase)
    assert not (d / "executed").exists(), "loading a controller file ran code from it"
    assert isinstance(load_controller(d / "good.pt"), PPOController)
    assert isinstance(load_controller(d / "good_dqn.pt"), DQNController)
    assert isinstance(load_controller(d / "good.json"), LogisticController)


def test_ppo_roundtrip_with_numpy_scalars(tmp_path):
    # export_ppo may hand over numpy scalars; a weights-only load must still read what save() wrote
    ctrl = ppo_controller(obs_mean=np.full(N, 0.2), obs_var=np.full(N, 2.0), epsilon=np.float64(1e-8),
                          clip=np.float32(np.inf), lam=np.float64(4.0))
    ctrl.save(tmp_path / "c.pt")
    back = load_controller(tmp_path / "c.pt")
    xs = np.random.default_rng(0).uniform(0, 1, (200, N)).astype(np.float32)
    assert back.lam == 4.0 and np.array_equal(back.decide_batch(xs), ctrl.decide_batch(xs))


@pytest.mark.parametrize("name", ["random.pt", "code.pt", "list.json", "no_weights.json", "dqn_shape.pt"])
def test_evaluate_refuses_bad_controller_in_one_line(bad_controllers, name):
    path, phrase = bad_controllers[1][name]
    out = run_cli("--policy", "rift-ada", "--controller", str(path), *FAST)
    assert_one_line_exit_2(out, str(path), phrase)
    assert "weights_only" not in out.stderr


# --- runtime options (--device, --dtype, --threads) -------------------------------------------------------------

def runtime_args(*argv):
    p = argparse.ArgumentParser()
    add_runtime_options(p)
    return p.parse_args(list(argv))


def test_apply_runtime_checks_and_applies():
    bad = [(["--dtype", "bogus"], "--dtype"), (["--threads", "0"], "--threads must be >= 1"),
           (["--device", "gpu"], "not a device")]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda"], "CUDA is not available"))
    for argv, phrase in bad:
        with pytest.raises(ValueError) as e:
            apply_runtime(runtime_args(*argv))
        one_line(e.value, phrase)
    args = runtime_args("--dtype", "bf16", "--device", "cpu")
    assert args.threads == 1
    apply_runtime(args)
    assert args.dtype == "bfloat16" and torch.get_num_threads() == 1


@pytest.mark.parametrize("argv,phrase", [
    (["--dtype", "bogus"], "unsupported dtype 'bogus'"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--threads", "two"], "invalid int value"),  # argparse's own errors: one line too
    (["--top-k", "-1", "--temperature", "1"], "--top-k: must be an integer >= 0"),
    (["--draft-step", "fast"], "--draft-step: invalid choice: 'fast'"),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_evaluate_runtime_options_one_line(argv, phrase):
    assert_one_line_exit_2(run_cli(*argv, *FAST), phrase)


@pytest.mark.parametrize("script,argv,phrase", [
    ("experiments/policy_table.py", ["--dtype", "bogus"], "unsupported dtype 'bogus'"),
    ("experiments/policy_table.py", ["--output", "/no/such/folder/t.json"], "folder does not exist"),
    ("experiments/bench_decode.py", ["--threads", "0"], "--threads must be >= 1"),
    ("experiments/bench_decode.py", ["--lengths", "0"], "--lengths must be >= 1"),
])
def test_experiment_scripts_runtime_options_one_line(script, argv, phrase):
    assert_one_line_exit_2(run_cli(*argv, script=script), phrase)


# --- models -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken_models(tmp_path_factory):
    """Copies of the testbed draft folder with a truncated / random / partial model.safetensors."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("models")
    weights = (TESTBED_DIR / "lm-draft" / "model.safetensors").read_bytes()
    state = load_file(TESTBED_DIR / "lm-draft" / "model.safetensors")
    out = {}
    for name in ("truncated", "random", "partial"):
        folder = root / name
        shutil.copytree(TESTBED_DIR / "lm-draft", folder)
        out[name] = folder
    (out["truncated"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (out["random"] / "model.safetensors").write_bytes(os.urandom(5000))
    save_file({k: v for k, v in state.items() if ".mlp." not in k}, out["partial"] / "model.safetensors",
              metadata={"format": "pt"})
    return out


def test_corrupt_model_folder_is_one_model_load_error(broken_models):
    for name, phrase in (("truncated", "truncated or corrupt"), ("random", "truncated or corrupt"),
                         ("partial", "lacks weights for model.layers.0.mlp")):
        with pytest.raises(ModelLoadError) as e:
            load_model(broken_models[name])
        one_line(e.value, phrase, name)
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model("testbed-draft", dtype="float64x")


def test_evaluate_refuses_corrupt_model_in_one_line(broken_models):
    out = run_cli("--drafter", str(broken_models["truncated"]), *FAST)
    assert_one_line_exit_2(out, "model.safetensors is truncated or corrupt")


# --- LoRA adapters ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter(tmp_path_factory, testbed_draft):
    folder = tmp_path_factory.mktemp("lora") / "adapter"
    torch.manual_seed(0)
    lora.save(lora.attach(copy.deepcopy(testbed_draft), rank=4), lora.fingerprint(testbed_draft), folder)
    return folder


def test_fingerprint_is_exact_and_thread_independent(testbed_draft):
    try:
        torch.set_num_threads(1)
        one = lora.fingerprint(testbed_draft)
        torch.set_num_threads(2)
        two = lora.fingerprint(testbed_draft)
    finally:
        torch.set_num_threads(1)
    assert one == two and len(one["embedding_sha256"]["float32"]) == 64


def test_adapter_loads_on_its_base_and_is_refused_elsewhere(adapter, testbed_draft, testbed_target):
    lora.load_drafter(testbed_draft, adapter)
    lora.load_drafter(load_model("testbed-lm-draft", dtype="bfloat16"), adapter)  # the same checkpoint, in bf16
    with pytest.raises(ValueError) as e:
        lora.load_drafter(testbed_target, adapter)
    one_line(e.value, "another base model", "hidden_size 192 (adapter) vs 256 (given)")
    same_shape = copy.deepcopy(testbed_draft)
    with torch.no_grad():
        same_shape.get_input_embeddings().weight[0, 0] += 1e-3  # one weight differs: a float sum could miss it
    with pytest.raises(ValueError) as e:
        lora.load_drafter(same_shape, adapter)
    one_line(e.value, "another base model", "embedding weights differ")


def test_damaged_adapter_files_are_one_line(adapter, testbed_draft, tmp_path):
    cases = {"adapter_model.safetensors": (b"\x00" * 100, "truncated or corrupt"),
             "adapter_config.json": (b"{", "not valid JSON"), "rift_base.json": (b"[1]", "JSON object")}
    for name, (data, phrase) in cases.items():
        folder = tmp_path / name
        shutil.copytree(adapter, folder)
        (folder / name).write_bytes(data)
        with pytest.raises(ValueError) as e:
            lora.load_drafter(testbed_draft, folder)
        one_line(e.value, phrase, name)
    folder = tmp_path / "truncated"
    shutil.copytree(adapter, folder)
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(weights[: len(weights) - 100])
    out = run_cli("--target", "testbed-lm", "--drafter", "testbed-lm", "--lora", str(folder), *FAST)
    assert_one_line_exit_2(out, "adapter_model.safetensors is truncated or corrupt")


def test_adapter_with_legacy_checksum_still_loads(adapter, testbed_draft, testbed_target, tmp_path):
    folder = tmp_path / "legacy"
    shutil.copytree(adapter, folder)
    cfg, emb = testbed_draft.config, testbed_draft.get_input_embeddings().weight.detach().float()
    fp = {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
          "num_hidden_layers": cfg.num_hidden_layers,
          "embedding_checksum": round(float(emb.sum() + (emb * emb).sum()), 3)}  # what older versions wrote
    (folder / lora.FINGERPRINT_FILE).write_text(json.dumps(fp))
    lora.load_drafter(testbed_draft, folder)
    with pytest.raises(ValueError, match="another base model"):
        lora.load_drafter(testbed_target, folder)


# --- prompt files -----------------------------------------------------------------------------------------------

def speedbench_row(i, **kw):
    return {"question_id": f"q{i}", "category": "mixed", "turns": ["hello"], **kw}


def test_speedbench_wrong_schema_names_row_and_field(tmp_path):
    lines = {"missing.jsonl": ([json.dumps({"question_id": "q0", "turns": ["x"]})], "row 0",
                               "missing field(s) category"),
             "category.jsonl": ([json.dumps(speedbench_row(0)), json.dumps(speedbench_row(1, category=3))],
                                "row 1", "'category' must be a string"),
             "qid.jsonl": ([json.dumps(speedbench_row(0, question_id=[1]))], "row 0", "'question_id'"),
             "turns.jsonl": ([json.dumps(speedbench_row(0, turns="hello"))], "row 0", "'turns' must be"),
             "array.jsonl": ([json.dumps([speedbench_row(0)])], "row 0", "got a list"),
             "not_json.jsonl": ([json.dumps(speedbench_row(0)), "question_id,category"], "not_json.jsonl:2",
                                "not valid JSON")}
    for name, (rows, where, phrase) in lines.items():
        (tmp_path / name).write_text("\n".join(rows) + "\n")
        with pytest.raises(ValueError) as e:
            load_speedbench(tmp_path / name)
        one_line(e.value, where, phrase)
    (tmp_path / "binary.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError) as e:
        load_speedbench(tmp_path / "binary.jsonl")
    one_line(e.value, "binary.jsonl", "not UTF-8")
    pytest.importorskip("pyarrow")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError) as e:
        load_speedbench(tmp_path / "broken.parquet")
    one_line(e.value, "broken.parquet", "not a readable parquet file")


def test_jsonl_prompts_not_text_is_one_line(tmp_path):
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "\xff\xfe"}\n')
    with pytest.raises(ValueError) as e:
        load_jsonl(tmp_path / "p.jsonl")
    one_line(e.value, "p.jsonl", "not UTF-8")


# --- budgets larger than the prompt -----------------------------------------------------------------------------

def test_budget_above_prompt_length_is_stated_not_refused(capsys):
    from rift_ada.evaluate import build_parser, run

    out = run(build_parser().parse_args(["--policy", "rift-stat", "--budget", "4096", "--json",
                                         "--no-greedy-check", *FAST]))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "budget 4096 >= prompt length for 1 of 1 prompts" in notes[0], notes
    assert out["uncompressed_prompts"] == 1
    out = run(build_parser().parse_args(["--policy", "rift-stat", "--budget", "256", "--json",
                                         "--no-greedy-check", *FAST]))
    assert out["uncompressed_prompts"] == 0 and "note:" not in capsys.readouterr().err
