"""A figure of the run: its rows (CSV), its markdown table and its plot; writing it (CSV, PNG, W&B) and the summary."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rift_ada import distributed

FULL_STYLE = dict(color="black", ls="--", lw=1.5, zorder=3)  # drawn over the policies that match it


@dataclass
class Figure:
    key: str  # file stem
    title: str
    columns: list  # CSV columns
    rows: list  # dicts
    table: str  # markdown
    draw: Callable  # draws the plot on a matplotlib Axes (wide: on the Figure, several panels)
    wide: bool = False
    seconds: float = 0.0


def pct(budget: int | None, size: int) -> str:
    return "full" if budget is None else f"{budget} ({100 * budget / size:.3g}%)"


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def controller_label(ctrl) -> str:
    if ctrl is None:
        return ""
    rules = getattr(ctrl, "rules", None)
    if rules:
        return "threshold " + ", ".join(f"{s} {op} {v:g}" for s, op, v in rules)
    return ctrl.kind + (f" {ctrl.period}" if hasattr(ctrl, "period") else "")


def publish(fig: Figure, out: Path, run) -> None:
    """Rank 0: the figure's CSV and PNG, and both to W&B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(out / f"{fig.key}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fig.columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(fig.rows)
    mfig = plt.figure(figsize=(13, 4) if fig.wide else (8, 4.5))
    fig.draw(mfig if fig.wide else mfig.add_subplot())
    mfig.tight_layout()
    mfig.savefig(out / f"{fig.key}.png", dpi=110, bbox_inches="tight")  # legends outside the axes included
    plt.close(mfig)
    if run is not None:
        import wandb

        data = [[r.get(c) if c != "knob" else str(r.get(c)) for c in fig.columns] for r in fig.rows]
        run.log({f"{fig.key}/image": wandb.Image(str(out / f"{fig.key}.png")),
                 f"{fig.key}/table": wandb.Table(columns=fig.columns, data=data)})
        run.summary[f"{fig.key}/seconds"] = fig.seconds


def write_summary(out: Path, figs: list, b, adapter: str, total_s: float) -> None:
    """summary.md: the run's settings and every figure with its table (``b``: the run's EvaluationCache)."""
    a = b.args
    head = [f"# Figures ({'--quick, ' if a.quick else ''}target {a.target}, drafter {a.drafter})", "",
            "The built-in testbed is a pair of small trained Python LMs (`testbed`: with a hand-set long-range "
            "copier composed beside them): these figures test the pipeline and the methods' behaviour, not a claim "
            "about real LMs." if a.target.startswith("testbed") else "", "",
            f"{len(b.prompts['main'])} held-out prompts ({a.task if not (a.data or a.speedbench) else 'from file'}, "
            f"{b.input_size} tokens), {a.max_new_tokens} new tokens, k = {a.draft_length}, temperature "
            f"{a.temperature:g}, seed {a.seed}; budget {b.budget} tokens in figures 1, 3 and 4; rift-dyn period "
            f"{a.period}; rift-ada: {controller_label(b.rift_ada_controller())}; trained draft: {adapter}. Wall time "
            f"{total_s / 60:.1f} min ({distributed.world_size()} process(es), {a.threads} thread(s) each)."]
    body = []
    for i, f in enumerate(figs, 1):
        body += ["", f"## {i}. {f.title}", "", f"![{f.title}]({f.key}.png)", "", f.table, "",
                 f"({f.key}.csv; {f.seconds:.0f} s)"]
    (out / "summary.md").write_text("\n".join(head + body) + "\n")
