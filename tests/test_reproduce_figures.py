"""experiments/reproduce_figures.py: the --quick run in this process (real testbed models, a real LoRA training, a real
W&B offline run), its five figures checked against each other and against rift_ada.evaluate; --adapter reuses an
adapter; bad input ends in one line and exit code 2."""

import contextlib
import csv
import io
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("fig1_al_by_quarter", "fig2_al_by_budget", "fig3_al_by_input_length", "fig4_refresh_tradeoff",
           "fig5_training_table")

pytestmark = pytest.mark.slow


def script():
    """experiments/reproduce_figures.py as a module (its main is not run)."""
    from tests.conftest import script_module

    return script_module("reproduce_figures")


def read(out: Path, name: str) -> list[dict]:
    return list(csv.DictReader((out / f"{name}.csv").open()))


def num(x: str) -> float | None:
    return None if x == "" else float(x)


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")


def evaluate_json(*argv) -> dict:
    from rift_ada.evaluate import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--json", "--no-greedy-check", "--target", "testbed-lm", "--drafter", "testbed-lm", "--prompts", "2", "--input-tokens", "1024",
                     "--max-new-tokens", "64", *argv]) == 0
    return json.loads(buf.getvalue())


def test_quick_run_writes_five_consistent_figures_and_one_wandb_run(tmp_path, wandb_env, capsys):
    out = tmp_path / "figs"
    assert script().main(["--quick", "--target", "testbed-lm", "--drafter", "testbed-lm", "--output-dir", str(out)]) == 0

    for name in FIGURES:
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(png) < 200_000, name
        assert len(read(out, name)) >= 3, name
    summary = (out / "summary.md").read_text()
    assert summary.count("\n|---") == 5, "one markdown table per figure"
    assert all(f"({name}.png)" in summary for name in FIGURES) and "not a claim about real LMs" in summary

    f1 = {r["policy"]: r for r in read(out, "fig1_al_by_quarter")}
    f2 = {(r["draft"], r["policy"], num(r["budget_fraction"])): r for r in read(out, "fig2_al_by_budget")}
    f3 = {(int(r["input_tokens"]), r["policy"]): r for r in read(out, "fig3_al_by_input_length")}
    f4 = {(r["family"], r["knob"]): r for r in read(out, "fig4_refresh_tradeoff")}
    f5 = read(out, "fig5_training_table")
    al = lambda r: float(r["acceptance_length"])  # noqa: E731

    assert list(f1) == ["full", "window", "snapkv", "rift-stat", "rift-dyn", "rift-ada"]
    assert {k[1] for k in f3} == {"full", "snapkv", "rift-stat", "rift-dyn", "rift-ada"}
    assert {k[0] for k in f3} == {768, 1024, 1536}
    assert {k[0] for k in f4} == {"full", "never", "periodic", "threshold", "entropy"}
    # The same setting gives the same number in every figure: full cache, rift-stat and rift-dyn at 25% of the input
    # (--quick: 1024-token prompts, budget 256), rift-ada's threshold rule.
    assert int(f1["rift-stat"]["budget"]) == 256 == int(f2["untrained", "rift-stat", 0.25]["budget"])
    full = al(f1["full"])
    assert full == al(f2["untrained", "full", None]) == al(f3[1024, "full"]) == al(f4["full", "-"])
    assert al(f1["rift-stat"]) == al(f2["untrained", "rift-stat", 0.25]) == al(f3[1024, "rift-stat"]) \
        == al(f4["never", "-"])
    assert al(f1["rift-dyn"]) == al(f2["untrained", "rift-dyn", 0.25]) == al(f4["periodic", "32"])
    assert al(f1["rift-ada"]) == al(f4["threshold", "0.5"]) and f1["rift-ada"]["controller"].startswith("threshold")
    assert int(f1["rift-dyn"]["refreshes"]) > 0 and int(f1["rift-stat"]["refreshes"]) == 0
    for r in f4.values():
        assert float(r["al_vs_full"]) == pytest.approx(al(r) / full)
        assert (r["modelled_tokens_per_second"] == "") == (r["family"] == "full")
    # The training table is figure 2's numbers with their relative change.
    budgets = {frac for (_, _, frac) in f2 if frac is not None}
    assert 0.25 in budgets and len(f5) == 1 + 2 * len(budgets)  # full, then rift-stat and rift-dyn per budget
    for r in f5:
        frac = num(r["budget_fraction"])
        u, t = al(f2["untrained", r["policy"], frac]), al(f2["trained", r["policy"], frac])
        assert (float(r["al_untrained"]), float(r["al_trained"])) == (u, t)
        assert float(r["relative_change"]) == pytest.approx(t / u - 1, abs=1e-12)
    # ... and what rift_ada.evaluate prints for the same setting on the same held-out prompts.
    assert evaluate_json("--policy", "full")["acceptance_length"] == full
    for name in ("window", "snapkv", "rift-stat"):
        assert evaluate_json("--policy", name, "--budget", "256")["acceptance_length"] == al(f1[name]), name

    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert len(list(runs[0].glob("files/media/images/**/*.png"))) == 5
    tables = [json.loads(t.read_text()) for t in runs[0].glob("files/media/table/**/*.table.json")]
    assert sorted(len(t["data"]) for t in tables) == sorted(len(read(out, n)) for n in FIGURES)
    assert (out / "compressibility" / "adapter" / "adapter_config.json").is_file()

    # --adapter: no training; the same adapter gives the same trained AL on the same prompts.
    again = tmp_path / "again"
    capsys.readouterr()
    assert script().main(["--quick", "--target", "testbed-lm", "--drafter", "testbed-lm",
                          "--adapter", str(out / "compressibility" / "adapter"), "--budgets", "0.25",
                          "--input-lengths", "1024", "--periods", "32", "--acc-thresholds", "0.5",
                          "--entropy-quantiles", "0.5", "--oracle-lams", "1000", "--wandb-mode", "disabled",
                          "--output-dir", str(again)]) == 0
    assert not (again / "compressibility").exists()
    g2 = {(r["draft"], r["policy"], num(r["budget_fraction"])): r for r in read(again, "fig2_al_by_budget")}
    assert set(g2) == {(d, p, f) for d in ("untrained", "trained") for p, f in
                       (("full", None), ("rift-stat", 0.25), ("rift-dyn", 0.25))}
    assert all(al(g2[k]) == al(f2[k]) for k in g2)
    # The oracle at a refresh price of 1,000 accepted tokens (more than a 64-token generation can gain) keeps the
    # never-refreshing branch, so its row is the never-refresh decode's: same AL and modelled speed, no refresh.
    g4 = {r["family"]: r for r in read(again, "fig4_refresh_tradeoff")}
    oracle, never = g4["oracle"], g4["never"]
    assert oracle["knob"] == "1000.0" and oracle["refreshes"] == "0" and oracle["tokens_per_second"] == ""
    assert al(oracle) == pytest.approx(al(never), rel=1e-12)
    assert float(oracle["modelled_tokens_per_second"]) == pytest.approx(float(never["modelled_tokens_per_second"]),
                                                                        rel=1e-12)


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "1.5"], "--budgets are fractions of the input"),
    (["--controller", "missing.json"], "controller file 'missing.json' does not exist"),
    (["--adapter", "no-such-adapter"], "holds no LoRA adapter"),
    (["--budget", "8"], "smaller than the observation window"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, wandb_env, capsys, argv, message):
    try:
        code = script().main(["--quick", "--output-dir", str(tmp_path / "figs"), *argv])
    except SystemExit as e:  # argparse's errors
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "figs" / "compressibility").exists(), "refused before any training"
