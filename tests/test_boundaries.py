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


def import_cycles(package: Path, root: Path = ROOT) -> list[list[str]]:
    """Module sets of ``package`` that import each other in a circle (strongly connected components of the import
    graph, function-local imports included: a lazy import hides a circle from Python, not from a reader)."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package.rglob("*.py")}

    def deps(path: Path) -> set[str]:  # `from . import sub` imports the module sub, not its package's contents
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = list(path.relative_to(root).parent.parts)
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        return out

    graph = {m: {d for d in deps(p) if d in modules and d != m} for m, p in modules.items()}
    index, low, stack, cycles = {}, {}, [], []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles_in_the_core(tmp_path):
    assert import_cycles(ROOT / "rift_ada") == []
    # The check finds a circle: corpus -> sources (lazily) -> tasks -> corpus, as rift_ada/data once had.
    data = tmp_path / "rift_ada" / "data"
    data.mkdir(parents=True)
    for name, body in (("corpus", "def f():\n    from .sources import g\n"), ("sources", "from .tasks import h\n"),
                       ("tasks", "from .corpus import f\n"), ("jsonl", "from .tasks import h\n")):
        (data / f"{name}.py").write_text(body)
    assert import_cycles(tmp_path / "rift_ada", tmp_path) == [["rift_ada.data.corpus", "rift_ada.data.sources", "rift_ada.data.tasks"]]


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore is its module's own: another module that needs it gets a public one."""
    offenders = []
    for folder in ("rift_ada", "envs", "controllers", "trainers", "testbed", "experiments"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    offenders += [f"{path.relative_to(ROOT)}: {a.name} from {node.module}" for a in node.names
                                  if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, offenders


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
