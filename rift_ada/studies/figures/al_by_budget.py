"""Figure 2: AL across budgets (fractions of the input) for rift-stat and rift-dyn, untrained vs compressibility-trained
draft, with the full-cache AL of both drafts as reference lines."""

from __future__ import annotations

from .figure import Figure, pct

VARIANTS = ("rift-stat", "rift-dyn")  # figures 2 and 5
DRAFTS = ("untrained", "trained")


def budget_rows(b) -> list[dict]:
    """One row per draft, policy and budget (the full cache first): the numbers of figures 2 and 5."""
    rows = []
    for drafter in DRAFTS:
        s = b.evaluate(b.policy("full"), drafter, label=f"fig2 full {drafter}").summary
        rows.append({"draft": drafter, "policy": "full", "budget_fraction": None, "budget": None,
                     "acceptance_length": s["acceptance_length"], "refreshes": s["refreshes"]})
    for frac in b.args.budgets:
        for name in VARIANTS:
            for drafter in DRAFTS:
                pol = b.policy(name, b.budget_of(frac))
                s = b.evaluate(pol, drafter, label=f"fig2 {name} {frac:g} {drafter}").summary
                rows.append({"draft": drafter, "policy": name, "budget_fraction": frac, "budget": pol.layout.budget,
                             "acceptance_length": s["acceptance_length"], "refreshes": s["refreshes"]})
    return rows


def by_setting(rows: list[dict]) -> dict:
    """(draft, policy, budget fraction) -> row."""
    return {(r["draft"], r["policy"], r["budget_fraction"]): r for r in rows}


def figure(b) -> Figure:
    """AL across budgets, untrained vs compressibility-trained draft."""
    rows = budget_rows(b)
    get = by_setting(rows)
    lines = ["| policy | budget | AL untrained | AL trained | refreshes untrained | refreshes trained |",
             "|---|---|---|---|---|---|"]
    for name, frac in [("full", None)] + [(n, f) for f in b.args.budgets for n in VARIANTS]:
        u, t = get["untrained", name, frac], get["trained", name, frac]
        lines.append(f"| {name} | {pct(u['budget'], b.input_size)} | {u['acceptance_length']:.3f} | "
                     f"{t['acceptance_length']:.3f} | {u['refreshes']} | {t['refreshes']} |")

    def draw(ax):
        import numpy as np

        x = np.arange(len(b.args.budgets))
        width = 0.2
        colors = {"rift-stat": "tab:blue", "rift-dyn": "tab:orange"}
        for j, (name, drafter) in enumerate((n, d) for n in VARIANTS for d in DRAFTS):
            ys = [get[drafter, name, f]["acceptance_length"] for f in b.args.budgets]
            ax.bar(x + (j - 1.5) * width, ys, width, color=colors[name], edgecolor="black", linewidth=0.5,
                   hatch="//" if drafter == "trained" else None, label=f"{name}, {drafter}")
        for drafter, ls in (("untrained", "--"), ("trained", ":")):
            ax.axhline(get[drafter, "full", None]["acceptance_length"], color="grey", ls=ls,
                       label=f"full cache, {drafter}")
        ax.set_xticks(x, [f"{100 * f:g}%\n({b.budget_of(f)})" for f in b.args.budgets])
        ax.set_xlabel("draft KV budget (% of the input, tokens)")
        ax.set_ylabel("acceptance length")
        ax.set_title("AL across budgets: untrained vs compressibility-trained draft (hatched)", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))

    cols = ["draft", "policy", "budget_fraction", "budget", "acceptance_length", "refreshes"]
    return Figure("fig2_al_by_budget", "AL across budgets, untrained vs trained draft", cols, rows,
                  "\n".join(lines), draw)
