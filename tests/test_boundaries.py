"""Package boundaries: the core never imports the layers above it, no generic top-level name is installed, and a
named policy is nothing but a layout plus a controller."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABOVE = ("envs", "controllers", "trainers", "testbed")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                pkg = list(path.relative_to(ROOT).parent.parts)
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def test_core_never_imports_the_layers_above():
    offenders = {}
    for path in (ROOT / "rift_ada").rglob("*.py"):
        bad = {m for m in imported_modules(path)
               if m.split(".")[0] in ABOVE or any(m.startswith(f"rift_ada.{a}") for a in ABOVE)}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, offenders


def test_no_generic_top_level_names_installed(tmp_path):
    code = ("import importlib.util as u, json\n"
            f"print(json.dumps([u.find_spec(n) is None for n in {ABOVE!r}] + "
            "[u.find_spec('rift_ada.' + n) is not None for n in " f"{ABOVE!r}]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=""))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [True] * 2 * len(ABOVE)


def test_rift_dyn_is_a_rift_layout_plus_the_periodic_controller():
    from rift_ada.evaluate import build_parser, run

    common = ["--budget", "256", "--prompts", "2", "--input-tokens", "1024", "--max-new-tokens", "96", "--json",
              "--per-prompt", "--target", "testbed-lm", "--drafter", "testbed-lm"]
    dyn = run(build_parser().parse_args(["--policy", "rift-dyn", "--period", "32", *common]))
    ada = run(build_parser().parse_args(["--policy", "rift-ada", "--controller", "periodic:32", *common]))
    timing = ("tokens_per_second", "prefill_seconds", "rollback_ms_per_round", "policy")
    assert dyn["refreshes"] > 0
    assert {k: v for k, v in dyn.items() if k not in timing} == {k: v for k, v in ada.items() if k not in timing}
