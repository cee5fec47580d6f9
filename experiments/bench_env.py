"""Environment steps per second of the refresh environment, one process against one worker process per env, and of
the replay environment over tables.

    python experiments/bench_env.py                         # testbed, 1K-token low prompts, 1 / 2 / 4 envs
    python experiments/bench_env.py --envs 2 --vec subproc --steps 400
    python experiments/bench_env.py --replay-tables runs/controller/tables --envs 1 8 --steps 100000   # replay

One environment step is one speculation round (drafting k tokens, one target verify, a refresh when the action says
so). Every configuration steps the same envs (RefreshEnvSpec, seeds 0..n-1) with the same action rule (refresh
every --refresh-every-th round of each env), so they decode the same tokens; the clock starts after the first
reset (model loading and worker start-up are reported apart). Printed as a markdown table; --output writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import time

from rift_ada.cli import (ArgumentParser, add_cache_options, add_model_options, add_runtime_options,
                          add_task_options, apply_runtime, check_output, fail, policy_from_args, require_positive,
                          tasks_from_args, write_output)


def bench(specs, subproc: bool, steps: int, refresh_every: int) -> dict:
    """Step ``specs`` as one VecEnv until ``steps`` env steps in all; steps/s after the first reset."""
    from rift_ada.envs.vec import make_vec_env

    return step_until(lambda: make_vec_env(specs, subproc=subproc), "subproc" if subproc else "dummy", steps,
                      refresh_every)


def bench_replay(tables, n: int, steps: int, refresh_every: int) -> dict:
    """``n`` ReplayEnvs over ``tables`` in SB3's DummyVecEnv (what PPO and DQN step) until ``steps`` env steps."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from rift_ada.envs import ReplayEnv

    return step_until(lambda: DummyVecEnv([lambda: ReplayEnv(tables) for _ in range(n)]), "replay (dummy)", steps,
                      refresh_every)


def step_until(make_venv, vec: str, steps: int, refresh_every: int) -> dict:
    """Build and reset a VecEnv (its start-up time), then step it until ``steps`` env steps in all, each env
    refreshing every ``refresh_every``-th round of its episode."""
    import numpy as np

    t0 = time.perf_counter()
    venv = make_venv()
    venv.seed(0)
    venv.reset()
    startup = time.perf_counter() - t0
    n, done_steps, rounds = venv.num_envs, 0, np.zeros(venv.num_envs, dtype=int)
    t0 = time.perf_counter()
    while done_steps < steps:
        _, _, dones, _ = venv.step((rounds % refresh_every == 0).astype(int))
        rounds = np.where(dones, 0, rounds + 1)
        done_steps += n
    seconds = time.perf_counter() - t0
    venv.close()
    return {"envs": n, "vec": vec, "env_steps": done_steps, "seconds": seconds,
            "steps_per_second": done_steps / seconds, "startup_seconds": startup}


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, drafter="testbed")
    add_cache_options(p, policy=None, budget=256)
    p.add_argument("--draft-length", type=int, default=11)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    add_task_options(p, prompts=4, input_tokens=1024, task="low")
    p.add_argument("--envs", type=int, nargs="+", default=[1, 2, 4], help="numbers of envs to bench")
    p.add_argument("--vec", nargs="+", default=["dummy", "subproc"], choices=["dummy", "subproc"])
    p.add_argument("--steps", type=int, default=240, help="env steps per configuration (all envs together)")
    p.add_argument("--refresh-every", type=int, default=8, help="each env refreshes every n-th round")
    p.add_argument("--output", default=None, help="also write the rows here (JSON)")
    p.add_argument("--replay-tables", default=None,
                   help="a folder of replay tables (one setting): bench the replay environment over them instead")
    add_runtime_options(p)
    args = p.parse_args(argv)
    require_positive(p, args, ("steps", "refresh_every", "draft_length", "max_new_tokens"))
    if min(args.envs) < 1:
        p.error("--envs must be >= 1")
    try:
        apply_runtime(args)
        check_output(args.output)
        if args.replay_tables:
            from rift_ada.replay.table import load_folder

            tables = load_folder(args.replay_tables)
            rows = [bench_replay(tables, n, args.steps, args.refresh_every) for n in args.envs]
            return report(rows, args)
        layout = policy_from_args(args, "rift-ada", controller="never").layout
        from rift_ada.data import encode_prompts
        from rift_ada.envs.vec import RefreshEnvSpec, shared_pair

        pair = shared_pair(args.target, args.drafter, args.device, args.dtype)
        prompts = tuple(tuple(p) for p in encode_prompts(pair.tokenizer, tasks_from_args(args, pair.tokenizer)))
        rows = []
        for vec in args.vec:
            for n in args.envs:
                specs = [RefreshEnvSpec(prompts, layout, args.target, args.drafter, args.device, args.dtype,
                                        args.draft_length, args.temperature, seed=i,
                                        max_new_tokens=args.max_new_tokens, threads=args.threads) for i in range(n)]
                rows.append(bench(specs, vec == "subproc", args.steps, args.refresh_every))
                r = rows[-1]
                print(f"{vec} x{n}: {r['steps_per_second']:.1f} env steps/s", file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return fail(e)
    return report(rows, args)


def report(rows: list, args) -> int:
    base = rows[0]["steps_per_second"]
    print(f"| vec env | envs | env steps/s | vs {rows[0]['vec']} x{rows[0]['envs']} | start-up s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vec']} | {r['envs']} | {r['steps_per_second']:.1f} | {r['steps_per_second'] / base:.2f}x | "
              f"{r['startup_seconds']:.1f} |")
    write_output(args.output, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
