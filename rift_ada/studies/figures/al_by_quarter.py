"""Figure 1: AL by generation quarter for every policy at the run's budget (rift-ada: the first --controller, else
the threshold rule)."""

from __future__ import annotations

from rift_ada.policies import POLICIES

from .figure import FULL_STYLE, Figure, controller_label, fmt, pct


def figure(b) -> Figure:
    """AL by generation quarter, every policy."""
    rows = []
    for name in POLICIES:
        pol = b.policy(name, controller=b.rift_ada_controller())
        s = b.evaluate(pol, label=f"fig1 {name}").summary
        q = s["acceptance_length_by_quarter"]
        rows.append({"policy": name, "budget": pol.layout.budget, "input_tokens": b.input_size,
                     "acceptance_length": s["acceptance_length"], **{f"al_q{i + 1}": q[i] for i in range(4)},
                     "refreshes": s["refreshes"], "refreshes_per_1k": s["refreshes_per_1k_tokens"],
                     "tokens_per_second": s["tokens_per_second"], "draft_active_kv_bytes": s["draft_active_kv_bytes"],
                     "controller": controller_label(pol.controller)})
    full = rows[0]["acceptance_length"]
    lines = ["| policy | budget | AL | % of full | AL Q1 | AL Q2 | AL Q3 | AL Q4 | refreshes |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['policy']}{' (' + r['controller'] + ')' if r['policy'] == 'rift-ada' else ''} | "
              f"{pct(r['budget'], b.input_size)} | {r['acceptance_length']:.3f} | "
              f"{100 * r['acceptance_length'] / full:.1f}% | "
              + " | ".join(fmt(r[f"al_q{i}"], ".2f") for i in range(1, 5)) + f" | {r['refreshes']} |" for r in rows]

    def draw(ax):
        for r in rows:
            qs = [(i + 1, r[f"al_q{i + 1}"]) for i in range(4) if r[f"al_q{i + 1}"] is not None]
            ax.plot(*zip(*qs), marker="o", label=f"{r['policy']} (AL {r['acceptance_length']:.2f})",
                    **FULL_STYLE if r["policy"] == "full" else {})
        ax.set_xticks([1, 2, 3, 4], ["Q1", "Q2", "Q3", "Q4"])
        ax.set_xlabel("quarter of the generation")
        ax.set_ylabel("acceptance length (tokens / target step)")
        ax.set_title(f"AL across generation position, budget {pct(b.budget, b.input_size)}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))

    cols = ["policy", "controller", "budget", "input_tokens", "acceptance_length", "al_q1", "al_q2", "al_q3", "al_q4",
            "refreshes", "refreshes_per_1k", "tokens_per_second", "draft_active_kv_bytes"]
    return Figure("fig1_al_by_quarter", "AL across generation position", cols, rows, "\n".join(lines), draw)
