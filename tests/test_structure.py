"""The code's shape, kept by tests: scripts that read top to bottom (<= 250 lines), functions that fit a screen or
two (<= 80 lines), a README a user reads through (<= 450 lines), no ``sys.path`` edits, and a mutation list that
still applies to the code it mutates."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("rift_ada", "envs", "controllers", "trainers", "testbed", "experiments", "custom_generate")


def python_files(*folders):
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def test_experiment_scripts_stay_short():
    long = {p.name: n for p in python_files("experiments") if (n := len(p.read_text().splitlines())) > 250}
    assert not long, long


def test_no_function_runs_past_80_lines():
    long = []
    for path in python_files(*SOURCES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, long


def test_readme_stays_readable_and_nothing_edits_sys_path():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 450
    edits = [str(p.relative_to(ROOT)) for p in python_files(*SOURCES, "tests")
             if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()]
    assert edits == [str(Path(__file__).relative_to(ROOT))], edits  # this file names them, nothing else


def test_every_mutation_still_applies():
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "mutation_check.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_package_folder_is_installed():
    """A folder with an ``__init__.py`` missing from pyproject's package list imports from a checkout and is absent
    from an installed wheel (rift_ada.joint once was)."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {v: k for k, v in setup["package-dir"].items()}
    found = set()
    for init in (ROOT / "rift_ada").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for top, name in dirs.items():
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join((name, *init.parent.relative_to(ROOT / top).parts)))
    assert found - set(setup["packages"]) == set(), sorted(found - set(setup["packages"]))
