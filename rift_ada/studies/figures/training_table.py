"""Figure 5: the training table, figure 2's numbers with the relative change of AL after compressibility training."""

from __future__ import annotations

from . import al_by_budget
from .al_by_budget import VARIANTS
from .figure import Figure, pct


def figure(b) -> Figure:
    """The training table: figure 2's numbers (its evaluations, from the cache) with the relative change after
    compressibility training."""
    get = al_by_budget.by_setting(al_by_budget.budget_rows(b))
    rows = []
    for name, frac in [("full", None)] + [(n, f) for n in VARIANTS for f in b.args.budgets]:
        u, t = get["untrained", name, frac]["acceptance_length"], get["trained", name, frac]["acceptance_length"]
        rows.append({"policy": name, "budget_fraction": frac, "budget": get["untrained", name, frac]["budget"],
                     "al_untrained": u, "al_trained": t, "relative_change": t / u - 1})
    lines = ["| policy | budget | AL untrained | AL trained | change |", "|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {pct(r['budget'], b.input_size)} | {r['al_untrained']:.3f} | {r['al_trained']:.3f} "
              f"| {100 * r['relative_change']:+.1f}% |" for r in rows]

    def draw(ax):
        labels = [r["policy"] if r["budget"] is None else f"{r['policy']}\n{100 * r['budget_fraction']:g}%"
                  for r in rows]
        ys = [100 * r["relative_change"] for r in rows]
        ax.bar(range(len(rows)), ys, color=["tab:green" if y >= 0 else "tab:red" for y in ys], edgecolor="black",
               linewidth=0.5)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("AL change after compressibility training (%)")
        ax.set_title("Relative change of AL, trained vs untrained draft", fontsize=9)

    cols = ["policy", "budget_fraction", "budget", "al_untrained", "al_trained", "relative_change"]
    return Figure("fig5_training_table", "AL after compressibility training", cols, rows, "\n".join(lines), draw)
