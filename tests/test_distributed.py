"""Data-parallel evaluation under torchrun (two CPU processes, gloo) gives what one process gives, timings aside.

Each check launches ``python -m torch.distributed.run --standalone`` (a free port of its own) and compares rank 0's
output with the same run in this process.
"""

import json
import os
import runpy
import subprocess
import sys

import pytest

from rift_ada import distributed
from rift_ada.evaluate import build_parser, run

pytestmark = pytest.mark.slow

ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
ENV.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
# Wall-clock fields of the summary: recomputed from the gathered per-round timings, so not comparable.
TIMING = {"tokens_per_second", "prefill_seconds", "rollback_ms_per_round"}
COMMON = ["--json", "--per-prompt", "--target", "testbed-lm", "--drafter", "testbed-lm", "--prompts", "3", "--input-tokens", "1024",
          "--max-new-tokens", "32", "--policy", "rift-dyn", "--budget", "256", "--period", "32", "--device", "cpu"]


def torchrun(nproc: int, *argv) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(nproc), *argv], env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def without_timing(out: dict) -> dict:
    return {k: v for k, v in out.items() if k not in TIMING}


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_torchrun_cli_matches_one_process(temperature):
    argv = [*COMMON, "--temperature", temperature]
    out = torchrun(2, "-m", "rift_ada.evaluate", *argv)
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout  # rank 0 prints; rank 1 prints nothing
    dp = json.loads(lines[0])
    one = json.loads(json.dumps(run(build_parser().parse_args(argv))))  # as printed: tuples become lists
    assert set(dp) == set(one) and TIMING <= set(one)
    assert dp["per_prompt"] == one["per_prompt"]  # AL, refreshes, tokens generated, greedy match, prompt order
    assert without_timing(dp) == without_timing(one)
    assert [row["prompt"] for row in dp["per_prompt"]] == [0, 1, 2]
    if temperature == "0":
        assert dp["target_greedy_match"] == 1.0
    assert all(dp[k] > 0 for k in TIMING - {"rollback_ms_per_round"})


SCRIPT = '''
import dataclasses, json, sys

import torch

from rift_ada import distributed
from rift_ada.data import build_tasks, encode
from rift_ada.evaluate import evaluate
from rift_ada.models import load_pair
from rift_ada.policies import make_policy
from rift_ada.speculative import SpeculativeDecoder

TIMING = %r


def record(ev):
    """Everything an Evaluation holds but wall-clock times: tokens and every round's record per prompt."""
    return {"summary": {k: v for k, v in ev.summary.items() if k not in TIMING}, "rows": ev.rows,
            "results": [{"prompt_tokens": r.prompt_tokens, "tokens": r.tokens,
                         "rounds": [{k: v for k, v in dataclasses.asdict(x).items() if not k.endswith("_seconds")}
                                    for x in r.rounds]} for r in ev.results]}


def main(prefix):
    torch.set_num_threads(1)
    world = distributed.init("cpu")
    try:
        pair = load_pair("testbed-lm", "testbed-lm")
        policy = make_policy("rift-dyn", 256, period=32)
        dec = SpeculativeDecoder(pair.target, pair.draft, policy.layout, temperature=1.0,
                                 eos_token_id=pair.tokenizer.eos_token_id)
        tasks = build_tasks(pair.tokenizer, "low", n=3, input_tokens=1024, seed=0)
        prompts = [encode(pair.tokenizer, t.prompt) for t in tasks]
        out = {"world": world, "three": record(evaluate(dec, prompts, policy.controller, 32)),
               # fewer prompts than processes: rank 1's shard is empty
               "one": record(evaluate(dec, prompts[:1], policy.controller, 32))}
        with open(f"{prefix}.{distributed.rank()}.json", "w") as f:
            json.dump(out, f)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
'''


def test_evaluate_api_under_torchrun_sampling(tmp_path):
    """evaluate() itself, at temperature 1: the same tokens and round records per prompt as one process, every
    process gets the whole Evaluation, and a process with an empty shard is fine."""
    script = tmp_path / "eval_script.py"
    script.write_text(SCRIPT % (TIMING,))
    out = torchrun(2, str(script), str(tmp_path / "dp"))
    assert out.stdout == "", out.stdout
    ranks = [json.loads((tmp_path / f"dp.{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world"] == 2 and ranks[0] == ranks[1]
    assert distributed.world_size() == 1  # this process is not in a group: the reference runs alone
    runpy.run_path(str(script))["main"](str(tmp_path / "one"))
    one = json.loads((tmp_path / "one.0.json").read_text())
    assert one["world"] == 1
    for key in ("three", "one"):
        assert ranks[0][key] == one[key], key
    assert len(one["three"]["results"]) == 3 and len(one["one"]["results"]) == 1


def test_shard_and_gather_single_process():
    items = ["a", "b", "c"]
    assert distributed.shard(items) == [(0, "a"), (1, "b"), (2, "c")]
    assert distributed.gather([(1, "b"), (0, "a")]) == ["a", "b"]
    assert distributed.init("cpu") == 1 and distributed.is_main()
    assert distributed.local_device("cpu") == "cpu"


def test_torchrun_bad_input_is_one_line_from_rank_0():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "rift_ada.evaluate", "--prompts", "0", "--device", "cpu"], env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and out.stdout == ""
    ours = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert ours == ["error: --prompts must be >= 1"], out.stderr  # once, from rank 0
    assert "rift_ada/" not in out.stderr  # no traceback from the workers (torchrun adds its own failure report)
