"""The main job's report: tradeoff.csv, the two plots, metrics.json, the W&B table and plots, the exported controller
and the printed summary."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from rift_ada.resume import atomic_write

COLUMNS = ["family", "knob", "acceptance_length", "al_std", "al_vs_full", "refreshes_per_1k", "refreshes_per_1k_std",
           "refreshes", "refresh_savings", "oracle_share", "al_gain"]


@dataclass
class Tradeoff:
    """The sweep's outcome: one row per point after the full cache, with its modelled speed, and the matched
    comparison with periodic refresh (``rift_ada.tradeoff.matched_comparison``)."""

    full_al: float
    rows: list  # dicts of COLUMNS
    speeds: list  # modelled tokens per second, one per row
    summary: dict
    replay: list = None  # the same points replayed on the held-out tables (dicts of COLUMNS)
    replay_summary: dict = None


def best_of(tradeoff: Tradeoff, family: str) -> dict:
    """The family's row with the largest refresh savings at matched AL (then the largest AL): the one exported."""
    return max((r for r in tradeoff.rows if r["family"] == family),
               key=lambda r: (r["refresh_savings"] if r["refresh_savings"] is not None else -1.0,
                              r["acceptance_length"]))


def write_outputs(out: Path, t: Tradeoff, args, extra: dict, costs) -> list[dict]:
    """tradeoff.csv (never half a table: written in one step), the plots and metrics.json (``extra``: its other
    fields). Returns the rows with their modelled speed."""
    def csv_of(rows):
        def write(path):
            with open(path, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=COLUMNS)
                w.writeheader()
                w.writerows({c: r.get(c) for c in COLUMNS} for r in rows)
        return write

    atomic_write(out / "tradeoff.csv", csv_of(t.rows))
    if t.replay is not None:
        atomic_write(out / "tradeoff_replay.csv", csv_of(t.replay))
    # The modelled speed depends on the costs measured on this machine, so it stays out of tradeoff.csv (which a
    # resumed run reproduces bit for bit) and goes to metrics.json, the second plot and W&B.
    timed = [{**r, "modelled_tokens_per_s": v} for r, v in zip(t.rows, t.speeds)]
    title = f"draft KV budget {args.budget}, {args.input_tokens}-token prompts"
    plot(out / "tradeoff.png", timed, "acceptance_length", "acceptance length (tokens / target step)", title,
         t.full_al)
    plot(out / "tradeoff_time.png", timed, "modelled_tokens_per_s", "tokens / s (modelled)",
         f"{title}\nmodelled: draft step {1e3 * costs.draft_step_s:.2f} ms, verify {1e3 * costs.verify_s:.2f} ms, "
         f"refresh {1e3 * costs.refresh_s:.2f} ms")
    metrics = {"full_cache_acceptance_length": t.full_al, "rows": timed, "matched": t.summary["families"], **extra,
               "replayed_rows": t.replay, "replayed_matched": (t.replay_summary or {}).get("families"),
               "reward": args.reward, "costs": costs.to_dict()}
    atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1, default=str)))
    return timed


def plot(path: Path, rows: list, y: str, ylabel: str, title: str, full_line=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for fam in dict.fromkeys(r["family"] for r in rows):
        pts = sorted((r["refreshes_per_1k"], r[y]) for r in rows if r["family"] == fam)
        ax.plot(*zip(*pts), marker="o", label=fam)
    if full_line is not None:
        ax.axhline(full_line, color="grey", ls="--", label="full cache")
    ax.set_xlabel("refreshes per 1K generated tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def log_to_wandb(run, out: Path, t: Tradeoff, timed: list, costs) -> None:
    import wandb

    families = list(dict.fromkeys(r["family"] for r in timed))
    wcols = COLUMNS + ["modelled_tokens_per_s"]
    table = wandb.Table(columns=wcols,
                        data=[[str(r["knob"]) if c == "knob" else r.get(c) for c in wcols] for r in timed])
    xs = [[r["refreshes_per_1k"] for r in timed if r["family"] == f] for f in families]

    def ys(key):
        return [[r[key] for r in timed if r["family"] == f] for f in families]

    run.log({"tradeoff/table": table,
             "tradeoff/al_vs_refreshes": wandb.plot.line_series(xs=xs, ys=ys("acceptance_length"), keys=families,
                                                                title="AL vs refreshes per 1K tokens",
                                                                xname="refreshes per 1K tokens"),
             "tradeoff/tokens_per_s_vs_refreshes": wandb.plot.line_series(
                 xs=xs, ys=ys("modelled_tokens_per_s"), keys=families,
                 title="modelled tokens/s vs refreshes per 1K tokens", xname="refreshes per 1K tokens"),
             "tradeoff/al_vs_refreshes_png": wandb.Image(str(out / "tradeoff.png")),
             "tradeoff/tokens_per_s_vs_refreshes_png": wandb.Image(str(out / "tradeoff_time.png"))})
    for fam, s in t.summary["families"].items():
        run.summary[f"{fam}/refresh_savings_at_matched_al"] = s["refresh_savings"]
        run.summary[f"{fam}/al_gain_at_matched_refreshes"] = s["al_gain"]
    for fam, s in ((t.replay_summary or {}).get("families") or {}).items():
        run.summary[f"replay/{fam}/refresh_savings_at_matched_al"] = s["refresh_savings"]
        run.summary[f"replay/{fam}/oracle_share"] = s.get("oracle_share")
    run.summary["full_cache_acceptance_length"] = t.full_al
    run.summary.update({f"costs/{k}": v for k, v in costs.to_dict().items()})


def print_summary(t: Tradeoff, args, exported: dict, session_s: float) -> None:
    print(f"\nfull-cache AL {t.full_al:.3f} | budget {args.budget} | {args.eval_prompts} held-out prompts x "
          f"{args.eval_seeds} seed(s) from {args.source_dir or 'the standard library (held-out split)'}")
    print(f"{'family':>10} {'knob':>6} {'AL':>7} {'+-':>6} {'AL/full':>8} {'ref/1K':>8} {'tok/s*':>8}")
    for r, speed in zip(t.rows, t.speeds):
        print(f"{r['family']:>10} {str(r['knob']):>6} {r['acceptance_length']:7.3f} {r.get('al_std', 0):6.3f} "
              f"{r['al_vs_full']:8.3f} {r['refreshes_per_1k']:8.2f} {speed:8.1f}")
    print("* tokens per second modelled with the measured costs (tradeoff_time.png); the oracle's rows are replayed "
          "on the held-out tables")
    for fam, s in t.summary["families"].items():
        sav = "n/a" if s["refresh_savings"] is None else f"{100 * s['refresh_savings']:.1f}%"
        gain = "n/a" if s["al_gain"] is None else f"{s['al_gain']:+.3f}"
        print(f"{fam}: {sav} fewer refreshes than periodic at matched AL; AL gain at matched refresh count {gain}")
    if t.replay_summary is not None:
        print("replayed on the held-out tables (expectation; the oracle's world):")
        for fam, s in t.replay_summary["families"].items():
            sav = "n/a" if s["refresh_savings"] is None else f"{100 * s['refresh_savings']:.1f}%"
            share = "" if s.get("oracle_share") is None or fam == "oracle" else \
                f", {100 * s['oracle_share']:.0f}% of the oracle's saving at that AL"
            print(f"  {fam}: saves {sav} of periodic's refreshes at matched AL{share}")
    for fam, e in exported.items():
        print(f"exported {fam} (knob {e['knob']}) -> {e['file']}")
    print(f"this session {session_s:.0f} s")


def finish(out: Path, state, run, args, points, results, replayed, learned: list, timings: dict, data: dict, costs,
           t_start: float) -> None:
    """Matched comparisons against periodic refresh (the real decoder's; and every point in replay on the held-out
    tables), one exported controller per ``learned`` kind (its best point), and the report."""
    import time

    from rift_ada.resume import write_json
    from rift_ada.sweep import modelled_speed, tradeoff_row
    from rift_ada.tradeoff import matched_comparison

    full = results[0]["acceptance_length"]  # the full cache's point comes first
    # Modelled tokens/s: a function of the stored counts and the cost model (the full cache's point is left out: its
    # draft steps run on the whole prompt, not on the measured compressed cache).
    t = Tradeoff(full, [tradeoff_row(p, r, full) for p, r in zip(points[1:], results[1:])],
                 [modelled_speed(r, costs) for r in results[1:]], {})
    t.summary = matched_comparison(t.rows)  # adds refresh_savings / al_gain to the compared rows
    t.replay = [tradeoff_row(p, r, full) for p, r in zip(points[1:], replayed[1:])]
    t.replay_summary = matched_comparison(t.replay)
    exported = {}
    for family in learned:
        best = best_of(t, family)
        ctrl = next(p.controller for p in points if p.family == family and p.knob == best["knob"])
        path = out / f"controller-{family}{ctrl.suffix}"
        ctrl.save(path)
        exported[family] = {"file": str(path), "knob": best["knob"]}
    timings["session_s"] = time.time() - t_start  # this session's wall time
    extra = {"timings": timings, "exported": exported, "data": data}
    log_to_wandb(run, out, t, write_outputs(out, t, args, extra, costs), costs)
    run.summary.update({"session_seconds": timings["session_s"]})
    run.finish()
    write_json(state.path("done.json"), {"tradeoff": str(out / "tradeoff.csv")})
    print_summary(t, args, exported, timings["session_s"])
