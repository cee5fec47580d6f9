"""Mutation check: plant known bugs in a copy of the code and make sure the tests catch each one.

    python experiments/mutation_check.py                      # every mutation (about 15 minutes on one core)
    python experiments/mutation_check.py --only bonus-position q-wrong-step
    python experiments/mutation_check.py --list               # names, what each plants, which tests run
    python experiments/mutation_check.py --no-fail-fast       # run every chosen test, to count how many fail
    python experiments/mutation_check.py --check              # does every patch still apply? (runs no test)

The mutations are listed in ``experiments/mutations.py``. For each named mutation it copies the source tree to a
temporary folder, applies a textual patch (each ``old`` text must occur exactly once, so a patch that no longer
applies is reported instead of passing silently), runs the tests chosen for that mutation against the copy, and
reports KILLED (a test failed) or SURVIVED. The copy is put first on PYTHONPATH and is the working directory; since
the package is installed in editable mode, the script first checks that ``rift_ada`` and its sibling packages really
import from the copy.

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
from pathlib import Path

from mutations import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".benchmarks", "runs",
                                "wandb", "*.pyc")
PACKAGES = ("rift_ada", "rift_ada.controllers", "rift_ada.envs", "rift_ada.trainers", "rift_ada.testbed",
            "tests.conftest")
MAPPED = ("controllers", "envs", "trainers", "testbed")  # installed as rift_ada.<name> (pyproject package-dir)


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


def patched(tree: Path, mutation: Mutation) -> dict[Path, str]:
    """The files ``mutation`` patches in ``tree`` (the checkout or a copy of it), each with its patched text;
    RuntimeError unless every old text occurs exactly once."""
    texts = {}
    for rel, old, new in mutation.patches:
        # A mapped folder's file is imported from its copy under rift_ada/ (copy_tree): in a copy, patch that one.
        path = tree / "rift_ada" / rel if tree != ROOT and Path(rel).parts[0] in MAPPED else tree / rel
        text = texts[path] if path in texts else path.read_text()
        if text.count(old) != 1:
            raise RuntimeError(f"{mutation.name}: the text to replace occurs {text.count(old)} times in {rel} "
                               "(the code changed: update the patch)")
        texts[path] = text.replace(old, new)
    return texts


def apply(tree: Path, mutation: Mutation) -> None:
    for path, text in patched(tree, mutation).items():
        path.write_text(text)


def check_patches(chosen: list[Mutation]) -> int:
    """``--check``: whether every chosen patch applies to the checkout; nothing is copied and no test runs."""
    errors = []
    for m in chosen:
        try:
            patched(ROOT, m)
        except RuntimeError as e:
            errors.append(str(e))
    print(*errors, f"{len(chosen) - len(errors)} of {len(chosen)} mutations apply", sep="\n")
    return 2 if errors else 0


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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--check", action="store_true",
                   help="only check that each chosen mutation's patch still applies (no copies, no tests)")
    p.add_argument("--no-fail-fast", action="store_true", help="run every chosen test (default: stop at a failure)")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies (their paths are printed)")
    args = p.parse_args(argv)
    names = [m.name for m in MUTATIONS]
    unknown = set(args.only or []) - set(names)
    if unknown and not args.list:
        p.error(f"unknown mutation(s) {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    args.chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.what}\n    tests: {' '.join(m.tests)}")
        return 0
    if args.check:
        return check_patches(args.chosen)
    work = Path(tempfile.mkdtemp(prefix="mutation-check-"))
    try:
        return run(args.chosen, work, fail_fast=not args.no_fail_fast)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"copies kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(chosen: list[Mutation], work: Path, fail_fast: bool) -> int:
    """Every patch applied to its own copy under ``work``, the baseline run on an unmutated copy, then each
    mutation's tests on its copy; the exit status (see the module's docstring)."""
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
        code, summary, secs, failures = run_tests(tree, m.tests, fail_fast=fail_fast)
        result = {0: "SURVIVED", 1: "KILLED"}.get(code, f"ERROR (pytest exit {code})")
        status = max(status, {"KILLED": 0, "SURVIVED": 1}.get(result, 2))
        rows.append((m.name, ", ".join(t.split("::")[-1] for t in m.tests), f"{result}: {summary}", secs))
        print(f"{m.name}: {result} ({summary}, {secs:.0f} s)", *(f"    {f}" for f in failures), sep="\n", flush=True)
    print("\n| mutation | tests run | result | seconds |\n|---|---|---|---|")
    for name, tests, result, secs in rows:
        print(f"| {name} | {tests} | {result} | {secs:.0f} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
