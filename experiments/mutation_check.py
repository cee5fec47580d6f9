"""Mutation check: plant known bugs in a copy of the code and make sure the tests catch each one.

    python experiments/mutation_check.py                      # every mutation (about 15 minutes on one core)
    python experiments/mutation_check.py --only bonus-position q-wrong-step
    python experiments/mutation_check.py --list               # names, what each plants, which tests run
    python experiments/mutation_check.py --no-fail-fast       # run every chosen test, to count how many fail

For each named mutation it copies the source tree to a temporary folder, applies a textual patch (each ``old`` text
must occur exactly once, so a patch that no longer applies is reported instead of passing silently), runs the
tests chosen for that mutation against the copy, and reports KILLED (a test failed) or SURVIVED. The copy is put
first on PYTHONPATH and is the working directory; since the package is installed in editable mode, the script
first checks that ``rift_ada`` and its sibling packages really import from the copy.

Before any mutation the unmutated tree runs every chosen test (the baseline); a failing baseline aborts.
Exit status: 0 every mutation killed, 1 some survived, 2 the baseline failed, a patch did not apply, or a run
errored (e.g. collection failed). Not part of the default pytest run: it takes minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".benchmarks", "runs",
                                "wandb", "*.pyc")
PACKAGES = ("rift_ada", "rift_ada.controllers", "rift_ada.envs", "rift_ada.trainers", "tests.conftest")
MAPPED = ("controllers", "envs", "trainers")  # installed as rift_ada.<name> (pyproject package-dir)

SAMPLING = ["tests/test_sampling.py::test_joint_distribution_of_sequences_matches_target"]
TOP_P = ["tests/test_sampling.py::test_joint_distribution_of_sequences_matches_target[rift-dyn-top_p=0.8]"]
COLD = ["tests/test_sampling.py::test_joint_distribution_of_sequences_matches_target[full-T=0.7-top_p=0.85]"]
WINDOW = ["tests/test_cache.py::test_eviction_keeps_exactly_the_layout_positions",
          "tests/test_cache.py::test_tight_budget_holding_everything_equals_dense",
          "tests/test_speculative.py::test_greedy_equals_target_generate_testbed_policies"]

FAR_GATE = ["tests/test_circuit.py::test_far_gate_switches_the_far_window_off_after_a_sort_header"]

@dataclass
class Mutation:
    name: str
    what: str
    patches: list[tuple[str, str, str]]  # (file, old, new)
    tests: list[str]


MUTATIONS = [
    Mutation("keep-worst-selection", "selection keeps the lowest-scored positions",
             [("rift_ada/selection.py",
               'masked = scores.float().masked_fill(~candidates.to(scores.device), float("-inf"))\n'
               "    return masked.topk(n, dim=-1).indices",
               'masked = scores.float().masked_fill(~candidates.to(scores.device), float("inf"))\n'
               "    return masked.topk(n, dim=-1, largest=False).indices")],
             ["tests/test_cache.py::test_selection_keeps_the_best_scored_positions_per_head",
              "tests/test_regression.py::test_selection_beats_the_sliding_window"]),
    Mutation("window-keeps-one-more", "sliding window evicts one token too few",
             [("rift_ada/cache.py", "drop = 0 if keep is None else self.n_tail - keep\n",
               "drop = 0 if keep is None else self.n_tail - keep - 1\n")], WINDOW),
    Mutation("window-keeps-one-less", "sliding window evicts one token too many",
             [("rift_ada/cache.py", "drop = 0 if keep is None else self.n_tail - keep\n",
               "drop = 0 if keep is None else self.n_tail - keep + 1\n")], WINDOW),
    Mutation("bonus-position", "after k acceptances the bonus token comes from the last draft's position",
             [("rift_ada/speculative.py",
               "return len(drafts), self._sample(self._probs(t_logits[len(drafts)]), t_logits[len(drafts)])",
               "return len(drafts), self._sample(self._probs(t_logits[len(drafts) - 1]), t_logits[len(drafts) - 1])")],
             SAMPLING),
    Mutation("q-wrong-step", "the acceptance test uses the previous draft step's distribution q",
             [("rift_ada/speculative.py", "enumerate(zip(drafts, q_probs))",
               "enumerate(zip(drafts, q_probs[:1] + q_probs[:-1]))")], SAMPLING),
    Mutation("residual-unnormalised", "at a rejection, sample from max(p - q, 0) without dividing by its sum",
             [("rift_ada/speculative.py", "self._sample(residual / total if total > 0 else p",
               "self._sample(residual if total > 0 else p")], SAMPLING),
    Mutation("top-p-only-on-q", "the target's p in the acceptance test skips top-p (the draft's q has it)",
             [("rift_ada/speculative.py", "p = self._probs(t_logits[i])",
               "p = torch.softmax(t_logits[i].float() / self.temperature, -1)")], TOP_P),
    Mutation("temperature-inverted", "the sampling distribution is softmax(logits * T) instead of softmax(logits / T)",
             [("rift_ada/speculative.py", "p = torch.softmax(logits.float() / temperature, -1)",
               "p = torch.softmax(logits.float() * temperature, -1)")], COLD),
    Mutation("one-uniform-per-round", "one uniform draw decides every draft of a round (decisions not independent)",
             [("rift_ada/speculative.py",
               "        for i, (x, q) in enumerate(zip(drafts, q_probs)):\n"
               "            p = self._probs(t_logits[i])\n"
               "            u = torch.rand((), generator=self.generator, device=self.device)\n",
               "        u = torch.rand((), generator=self.generator, device=self.device)\n"
               "        for i, (x, q) in enumerate(zip(drafts, q_probs)):\n"
               "            p = self._probs(t_logits[i])\n")], COLD),
    Mutation("residual-from-p", "at a rejection, resample from p instead of norm(max(p - q, 0))",
             [("rift_ada/speculative.py", "self._sample(residual / total if total > 0 else p, t_logits[i])",
               "self._sample(p, t_logits[i])")], SAMPLING),
    Mutation("rollback-keeps-rejected", "the draft cache keeps one rejected token after a rollback",
             [("rift_ada/speculative.py", "self.dcache.rollback(fed_drafts - n)",
               "self.dcache.rollback(max(fed_drafts - n - 1, 0))")],
             ["tests/test_speculative.py::test_rollback_leaves_caches_as_if_never_fed"]),
    Mutation("draft-feeds-rejected-at-k-1", "a round that rejects only its last draft feeds that draft to the draft",
             [("rift_ada/speculative.py", "        if n <= fed_drafts:\n", "        if n < fed_drafts:\n")],
             ["tests/test_speculative.py::test_rollback_leaves_caches_as_if_never_fed"]),
    Mutation("hybrid-replay-skips-last-rejection",
             "a hybrid target does not replay when only the last draft is rejected",
             [("rift_ada/speculative.py", "replay = n < k and bool(self._t_states)",
               "replay = n < k - 1 and bool(self._t_states)")],
             ["tests/test_hybrid.py::test_rollback_equals_recomputing_from_scratch"]),
    Mutation("target-sliding-untrimmed-after-full-accept",
             "a round that accepts every draft skips the target's crop (its sliding layers keep the round's tokens)",
             [("rift_ada/speculative.py", "        else:\n            self.tcache.crop(-(k - n))\n",
               "        elif n < k:\n            self.tcache.crop(-(k - n))\n")],
             ["tests/test_architectures.py::test_rollback_with_sliding_layers_meets_every_accepted_count"]),
    Mutation("evaluate-drops-controller", "evaluate() decodes without the controller it is given (never refreshes)",
             [("rift_ada/evaluate.py", "res = decode(decoder, ids, max_new_tokens, controller)",
               "res = decode(decoder, ids, max_new_tokens)")],
             ["tests/test_controllers.py::test_exported_controller_drives_decoding_without_training_libraries"]),
    Mutation("refresh-keeps-drift", "a refresh does not remember its observation queries (the drift is not reset)",
             [("rift_ada/cache.py", "self._capacity(), upto)\n        self._remember_queries(upto)\n",
               "self._capacity(), upto)\n")],
             ["tests/test_cache.py::test_refresh_scores_from_scratch_resets_drift_and_rolls_back_exactly"]),
    Mutation("window-mask-off", "mid-round draft queries see the tail beyond their window (the round's start decides)",
             [("rift_ada/cache.py", "        if self.window is None or self.n_tail <= self.window + 1:\n",
               "        if True:\n")],
             ["tests/test_cache.py::test_eviction_keeps_exactly_the_layout_positions",
              "tests/test_cache.py::test_one_token_less_differs"]),
    Mutation("replay-row-ignores-pending", "a replayed refresh scores history up to the tokens generated, pending "
             "included", [("rift_ada/replay/process.py", "self.row = (g - self.pending) // self.G",
                           "self.row = g // self.G")],
             ["tests/test_replay.py::test_greedy_replay_follows_the_decoder_round_for_round"]),
    Mutation("replay-accepts-q", "sampled replay keeps a draft with probability q(x) instead of min(1, q/p)",
             [("rift_ada/replay/table.py", "return np.minimum(1.0, self.q / self.p[None])", "return self.q")],
             ["tests/test_replay.py::test_sampled_replay_keeps_drafts_with_the_rejection_rule_probability"]),
    Mutation("oracle-free-refresh", "the oracle's program forgets the refresh price it is asked for",
             [("rift_ada/replay/oracle.py", "go = keep[r_new] + refresh_price", "go = keep[r_new]")],
             ["tests/test_replay.py::test_oracle_is_the_cheapest_of_every_schedule"]),
    Mutation("since-refresh-not-reset", "tokens_since_refresh keeps counting through a refresh",
             [("rift_ada/speculative.py",
               "self.tokens_since_refresh = (0 if record.refreshed else self.tokens_since_refresh) + record.emitted",
               "self.tokens_since_refresh = self.tokens_since_refresh + record.emitted")],
             ["tests/test_speculative.py::test_tokens_since_refresh_restarts_at_each_refresh"]),
    Mutation("make-scorer-drops-unknown-options", "make_scorer silently drops options its scorer does not take",
             [("rift_ada/scorers/__init__.py", "    if unknown:\n", "    if False:\n")],
             ["tests/test_cache.py::test_policy_and_layout_errors"]),
    Mutation("refresh-cost-over-all-rounds", "the measured refresh cost is the median over every round",
             [("rift_ada/costs.py", "refresh_s=median(r.refresh_seconds for r in refreshed)",
               "refresh_s=median(r.refresh_seconds for r in rounds)")],
             ["tests/test_env.py::test_measured_costs_are_the_rounds_medians"]),
    Mutation("savings-not-interpolated",
             "the refresh rate periodic needs for an AL is its next point's, not interpolated",
             [("rift_ada/tradeoff.py", "return float(r1 if a1 == a0 else r0 + (al - a0) * (r1 - r0) / (a1 - a0))",
               "return float(r1)")],
             ["tests/test_train_controller.py::test_matched_comparison_on_known_points"]),
    Mutation("far-gate-never-fires", "the testbed target's far gate never counts a sort header",
             [("rift_ada/testbed/circuit.py", "ctx.rows(q_head, torch.tensor([c.match_dim + 1]))] = a * (hi - lo + 1)",
               "ctx.rows(q_head, torch.tensor([c.match_dim + 1]))] = 0.0")], FAR_GATE),
    Mutation("far-gate-keeps-the-far-query", "the far gate fires but leaves the far query window in place",
             [("rift_ada/testbed/circuit.py", "{col: 1.0}, col, gain=-1.0)", "{col: 1.0}, col, gain=0.0)")], FAR_GATE),
    Mutation("refresh-ignores-generated", "a refresh rescores only the prompt part of the backing store",
             [("rift_ada/cache.py", "        self.query_pos: torch.Tensor | None = None  # (nq,)\n",
               "        self.query_pos: torch.Tensor | None = None  # (nq,)\n        self.prompt_length = None\n"),
              ("rift_ada/cache.py",
               "        pos = select_importance(scorer, history_k, L, n_imp, tail_keep, *self.observation())\n",
               "        if self.prompt_length is None:  # the first selection (after prefill) sees the prompt\n"
               "            self.prompt_length = L\n"
               "        P = min(self.prompt_length, L)\n"
               "        pos = select_importance(scorer, history_k, P, n_imp, max(tail_keep - (L - P), 0),\n"
               "                                *self.observation())\n")],
             ["tests/test_cache.py::test_per_head_selection_and_refresh_reaches_generated_tokens",
              "tests/test_regression.py::test_pinned_acceptance_length[self/rift-dyn]"]),
]


def _ignore(directory: str, names: list[str]) -> set[str]:
    skip = set(IGNORE(directory, names))
    if Path(directory) == ROOT / "rift_ada":  # links to the mapped folders that a development checkout may keep
        skip |= set(MAPPED) & set(names)
    return skip


def copy_tree(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=_ignore)
    for name in MAPPED:  # where the import system finds rift_ada.<name> in the copy before the editable install
        shutil.copytree(dest / name, dest / "rift_ada" / name)
    return dest


def apply(tree: Path, mutation: Mutation) -> None:
    for rel, old, new in mutation.patches:
        path = tree / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise RuntimeError(f"{mutation.name}: the text to replace occurs {text.count(old)} times in {rel} "
                               "(the code changed: update the patch)")
        path.write_text(text.replace(old, new))


def environment(tree: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
                HF_HUB_OFFLINE="1", WANDB_MODE="offline")


def check_imports_from(tree: Path) -> None:
    """The package is installed in editable mode: make sure the copy, not the checkout, is what gets imported."""
    code = "import importlib\nfor m in %r: print(importlib.import_module(m).__file__)" % (PACKAGES,)
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=environment(tree), capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"importing from the copy failed:\n{out.stderr[-2000:]}")
    for module, path in zip(PACKAGES, out.stdout.split()):
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"{module} imports from {path}, not from the copy {tree}")


def run_tests(tree: Path, tests: list[str], fail_fast: bool) -> tuple[int, str, float, list[str]]:
    """(pytest exit code, its summary line, seconds, the FAILED / ERROR lines of its short summary)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",  # one process: a few tests
           *(["-x"] if fail_fast else []), *tests]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=tree, env=environment(tree), capture_output=True, text=True, timeout=3600)
    lines = [line for line in out.stdout.splitlines() if re.search(r"\b(passed|failed|error|no tests ran)\b", line)]
    summary = lines[-1].strip("= ") if lines else out.stdout[-300:]
    failures = [line[:160] for line in out.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return out.returncode, summary, time.perf_counter() - t0, failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--no-fail-fast", action="store_true", help="run every chosen test (default: stop at a failure)")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies (their paths are printed)")
    args = p.parse_args(argv)
    names = [m.name for m in MUTATIONS]
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.what}\n    tests: {' '.join(m.tests)}")
        return 0
    unknown = set(args.only or []) - set(names)
    if unknown:
        p.error(f"unknown mutation(s) {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    work = Path(tempfile.mkdtemp(prefix="mutation-check-"))
    try:
        base = copy_tree(work / "baseline")
        check_imports_from(base)
        for m in chosen:  # every patch must apply before anything runs for long
            apply(copy_tree(work / m.name), m)
        baseline = list(dict.fromkeys(t for m in chosen for t in m.tests))
        print(f"baseline: {len(baseline)} test selections on the unmutated tree ...", flush=True)
        code, summary, secs, failures = run_tests(base, baseline, fail_fast=False)
        print(f"baseline: {summary} ({secs:.0f} s)", flush=True)
        if code != 0:
            print("the unmutated tree fails the chosen tests: fix that first", *failures, sep="\n", file=sys.stderr)
            return 2
        rows, status = [], 0
        for m in chosen:
            tree = work / m.name
            check_imports_from(tree)
            code, summary, secs, failures = run_tests(tree, m.tests, fail_fast=not args.no_fail_fast)
            result = {0: "SURVIVED", 1: "KILLED"}.get(code, f"ERROR (pytest exit {code})")
            status = max(status, {"KILLED": 0, "SURVIVED": 1}.get(result, 2))
            rows.append((m.name, ", ".join(t.split("::")[-1] for t in m.tests), f"{result}: {summary}", secs))
            print(f"{m.name}: {result} ({summary}, {secs:.0f} s)", *(f"    {f}" for f in failures), sep="\n",
                  flush=True)
        print("\n| mutation | tests run | result | seconds |\n|---|---|---|---|")
        for name, tests, result, secs in rows:
            print(f"| {name} | {tests} | {result} | {secs:.0f} |")
        return status
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"copies kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
