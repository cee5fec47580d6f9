"""Figure 3: AL across input lengths (--input-lengths) at a fixed budget."""

from __future__ import annotations

from .figure import FULL_STYLE, Figure

POLICIES = ("full", "snapkv", "rift-stat", "rift-dyn", "rift-ada")


def figure(b) -> Figure:
    """AL across input lengths at a fixed budget."""
    rows = []
    for length in b.args.input_lengths:
        name = f"len-{length}"
        if not b.prompts.get(name):
            continue
        mean_len = sum(map(len, b.prompts[name])) / len(b.prompts[name])
        for pol_name in POLICIES:
            pol = b.policy(pol_name, controller=b.rift_ada_controller())
            s = b.evaluate(pol, prompts=name, label=f"fig3 {length} {pol_name}").summary
            rows.append({"input_tokens": length, "prompt_tokens_mean": mean_len, "prompts": s["prompts"],
                         "policy": pol_name, "budget": pol.layout.budget, "acceptance_length": s["acceptance_length"],
                         "refreshes": s["refreshes"], "draft_active_kv_bytes": s["draft_active_kv_bytes"]})
    lengths = list(dict.fromkeys(r["input_tokens"] for r in rows))
    get = {(r["input_tokens"], r["policy"]): r for r in rows}
    lines = ["| input tokens (mean prompt) | budget (% of prompt) | " + " | ".join(POLICIES) + " |",
             "|---|---|" + "---|" * len(POLICIES)]
    lines += [f"| {n} ({get[n, 'full']['prompt_tokens_mean']:.0f}) | "
              f"{b.budget} ({100 * b.budget / get[n, 'full']['prompt_tokens_mean']:.3g}%) | "
              + " | ".join(f"{get[n, p]['acceptance_length']:.3f}" for p in POLICIES) + " |" for n in lengths]

    def draw(ax):
        xs = [get[n, "full"]["prompt_tokens_mean"] for n in lengths]  # the prompts' actual mean length
        for p in POLICIES:
            ax.plot(xs, [get[n, p]["acceptance_length"] for n in lengths], marker="o", label=p,
                    **FULL_STYLE if p == "full" else {})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("prompt length (tokens, mean over the prompts)")
        ax.set_ylabel("acceptance length")
        ax.set_title(f"AL across input lengths, budget {b.budget} tokens", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))

    cols = ["input_tokens", "prompt_tokens_mean", "prompts", "policy", "budget", "acceptance_length", "refreshes",
            "draft_active_kv_bytes"]
    return Figure("fig3_al_by_input_length", "AL across input lengths at a fixed budget", cols, rows,
                  "\n".join(lines), draw)
