"""The main job's report: the replayed tradeoff (tradeoff.csv, with bootstrap intervals over the held-out prompts),
the real decoder's check of it (tradeoff_check.csv), the two plots, metrics.json, the W&B table and plots, the
exported controllers and the printed summary."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from rift_ada.resume import atomic_write

COLUMNS = ["family", "knob", "acceptance_length", "al_lo", "al_hi", "al_vs_full", "refreshes_per_1k",
           "refreshes_per_1k_lo", "refreshes_per_1k_hi", "refreshes", "refresh_savings", "refresh_savings_lo",
           "refresh_savings_hi", "oracle_share", "oracle_share_lo", "oracle_share_hi", "al_gain", "al_gain_lo",
           "al_gain_hi"]
CHECK_COLUMNS = ["family", "knob", "acceptance_length", "al_lo", "al_hi", "refreshes_per_1k", "refreshes_per_1k_lo",
                 "refreshes_per_1k_hi", "replayed_al", "replayed_refreshes_per_1k", "al_real_over_replayed",
                 "al_within", "refreshes_within"]
LO_HI = {"acceptance_length": ("al_lo", "al_hi"), "refreshes_per_1k": ("refreshes_per_1k_lo", "refreshes_per_1k_hi"),
         "refresh_savings": ("refresh_savings_lo", "refresh_savings_hi"),
         "oracle_share": ("oracle_share_lo", "oracle_share_hi"), "al_gain": ("al_gain_lo", "al_gain_hi"),
         "modelled_tokens_per_s": ("tokens_per_s_lo", "tokens_per_s_hi")}


def add_eval_options(group) -> None:
    """The held-out prompts, the real decoder's check of their replay and the intervals (:func:`check_problem`)."""
    group.add_argument("--eval-prompts", type=int, default=12,
                       help="held-out prompts: their replay tables give the tradeoff curves and the headline "
                            "(intervals: bootstrap over these prompts)")
    group.add_argument("--eval-seeds", type=int, default=1,
                       help="sampled continuations (tables, and real-decoder seeds) per held-out prompt")
    group.add_argument("--check-prompts", type=int, default=None,
                       help="the first of the held-out prompts decoded for real at --check-periods and the "
                            "--check-learners points: the check of the replay (default: 3, or --eval-prompts if "
                            "fewer; 0: no check)")
    group.add_argument("--check-periods", type=int, nargs="*", default=[32],
                       help="periodic refresh's periods in the real-decoder check")
    group.add_argument("--check-learners", default="tree,ppo",
                       help="the learned kinds whose points the real decoder checks (comma-separated, or all)")
    group.add_argument("--resamples", type=int, default=1000,
                       help="bootstrap resamples of the held-out prompts for the intervals")


def check_problem(args) -> str | None:
    """What is wrong with the check's options (one line), or None; fills --check-prompts' default."""
    from rift_ada.refresh.registry import learned

    if args.check_prompts is None:
        args.check_prompts = min(3, args.eval_prompts)
    if not 0 <= args.check_prompts <= args.eval_prompts:
        return f"--check-prompts must be in 0 .. --eval-prompts ({args.eval_prompts}), got {args.check_prompts}"
    if any(x < 1 for x in args.check_periods):
        return "--check-periods must be >= 1"
    kinds = [c.kind for c in learned()]
    wrong = [k for k in args.check_learners.split(",") if k not in kinds + ["all"]]
    if wrong:
        return f"--check-learners: {', '.join(wrong)} not a learned kind ({', '.join(kinds)}, or all)"
    return None


@dataclass
class Swept:
    """Points and their counts (a replay's or a real decode's), in the same order."""

    points: list
    counts: list

    @property
    def labels(self) -> list:
        return [(p.family, p.knob) for p in self.points]


def per_prompt(counts: dict, seeds: int, replayed: bool) -> list[dict]:
    """A point's numbers per prompt: a replay lists one table per (prompt, seed), prompt-major; a real decode one
    entry per prompt per seed, seed-major (``rift_ada.sweep.merge_seeds``)."""
    from rift_ada.tradeoff import prompt_counts

    if not replayed:
        return prompt_counts(counts)
    per = counts["per_prompt"]
    tagged = [{**per[i * seeds + s], "seed": s} for s in range(seeds) for i in range(len(per) // seeds)]
    return prompt_counts({"per_prompt": tagged})


def with_intervals(rows: list[dict], boot: dict) -> list[dict]:
    """``rows`` with each statistic's interval from :func:`rift_ada.tradeoff.bootstrap` as <lo>/<hi> columns."""
    out = []
    for r, b in zip(rows, boot["rows"]):
        r = dict(r)
        for stat, (lo, hi) in LO_HI.items():
            if b.get(stat) is not None and r.get(stat) is not None:
                r[lo], r[hi] = b[stat]
        out.append(r)
    return out


def replayed_tradeoff(swept: Swept, args, costs, prompts=None) -> tuple[list[dict], dict]:
    """Rows (full cache first) with intervals, and the families' matched comparison with intervals, over the
    held-out ``prompts`` (indices; None: all)."""
    import numpy as np

    from rift_ada.tradeoff import bootstrap, matched_comparison, rows_on, with_family_intervals

    per = [per_prompt(c, args.eval_seeds, replayed=True) for c in swept.counts]
    idx = np.arange(len(per[0])) if prompts is None else np.asarray(prompts)
    full = float(np.mean([per[0][i]["acceptance_length"] for i in idx]))
    rows = rows_on(swept.labels, per, idx, full, costs)
    summary = matched_comparison(rows[1:])
    boot = bootstrap(swept.labels, per, per[0], idx, costs, args.resamples, args.seed)
    return with_intervals(rows, boot), with_family_intervals(summary["families"], boot)


def check_rows(check: Swept, replay: Swept, args) -> list[dict]:
    """The real decoder's points on the check prompts, each with its interval (bootstrap over those prompts, the
    same seeds at every point) and the replay of the same point on the same prompts' tables beside it."""
    import numpy as np

    from rift_ada.tradeoff import bootstrap, rows_on

    if not check.points:
        return []
    per = [per_prompt(c, args.eval_seeds, replayed=False) for c in check.counts]
    idx = np.arange(args.check_prompts)
    rows = with_intervals(rows_on(check.labels, per, idx),
                          bootstrap(check.labels, per, None, idx, None, args.resamples, args.seed, compare=False))
    by_label = dict(zip(replay.labels, replay.counts))
    replayed = rows_on(check.labels, [per_prompt(by_label[lab], args.eval_seeds, replayed=True)
                                      for lab in check.labels], idx)
    for r, p in zip(rows, replayed):
        r["replayed_al"], r["replayed_refreshes_per_1k"] = p["acceptance_length"], p["refreshes_per_1k"]
        r["al_real_over_replayed"] = r["acceptance_length"] / p["acceptance_length"]
        r["al_within"] = bool(r["al_lo"] <= p["acceptance_length"] <= r["al_hi"])
        r["refreshes_within"] = bool(r["refreshes_per_1k_lo"] - 1e-9 <= p["refreshes_per_1k"]
                                     <= r["refreshes_per_1k_hi"] + 1e-9)
    return rows


def best_of(rows: list[dict], family: str) -> dict:
    """The family's row with the largest refresh savings at matched AL (then the largest AL): the one exported."""
    return max((r for r in rows if r["family"] == family),
               key=lambda r: (r["refresh_savings"] if r.get("refresh_savings") is not None else -1.0,
                              r["acceptance_length"]))


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    def write(tmp):
        with open(tmp, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=columns)
            w.writeheader()
            w.writerows({c: r.get(c) for c in columns} for r in rows)

    atomic_write(path, write)  # never half a table: written in one step


def plot(path: Path, rows: list, y: str, ylabel: str, title: str, check: list | None = None, full=None) -> None:
    """Each family's points with their intervals (both axes); the real decoder's check points hollow beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo_y, hi_y = LO_HI[y]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))

    def draw(rs, label, **kw):
        rs = sorted(rs, key=lambda r: r["refreshes_per_1k"])
        x = [r["refreshes_per_1k"] for r in rs]
        v = [r[y] for r in rs]
        xerr = [[r["refreshes_per_1k"] - r["refreshes_per_1k_lo"] for r in rs],
                [r["refreshes_per_1k_hi"] - r["refreshes_per_1k"] for r in rs]]
        yerr = [[r[y] - r[lo_y] for r in rs], [r[hi_y] - r[y] for r in rs]]
        return ax.errorbar(x, v, xerr=xerr, yerr=yerr, label=label, capsize=2, **kw)

    colours = {}
    for fam in dict.fromkeys(r["family"] for r in rows if r["family"] != "full"):
        h = draw([r for r in rows if r["family"] == fam], fam, marker="o", ms=4)
        colours[fam] = h[0].get_color()
    for fam in dict.fromkeys(r["family"] for r in check or []):
        draw([r for r in check if r["family"] == fam], f"{fam}, real decoder", marker="s", ms=6, ls="none",
             mfc="none", color=colours.get(fam))
    if full is not None and full.get(lo_y) is not None:
        ax.axhspan(full[lo_y], full[hi_y], color="grey", alpha=0.15)
        ax.axhline(full[y], color="grey", ls="--", label="full cache")
    ax.set_xlabel("refreshes per 1K generated tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def log_to_wandb(run, out: Path, rows: list, summary: dict, by_task: dict, check: list, costs) -> None:
    """The table, the curves (each family's point line and its interval's two bounds as lines of their own) and the
    images."""
    import wandb

    cols = COLUMNS + ["modelled_tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi"]
    table = wandb.Table(columns=cols, data=[[str(r["knob"]) if c == "knob" else r.get(c) for c in cols]
                                            for r in rows])
    families = [f for f in dict.fromkeys(r["family"] for r in rows) if f != "full"]

    def series(key, lo, hi):
        xs, ys, keys = [], [], []
        for f in families:
            rs = sorted((r for r in rows if r["family"] == f), key=lambda r: r["refreshes_per_1k"])
            for name, col in ((f, key), (f"{f} (lo)", lo), (f"{f} (hi)", hi)):
                xs.append([r["refreshes_per_1k"] for r in rs])
                ys.append([r.get(col) for r in rs])
                keys.append(name)
        return xs, ys, keys

    logged = {"tradeoff/table": table,
              "tradeoff/al_vs_refreshes_png": wandb.Image(str(out / "tradeoff.png")),
              "tradeoff/tokens_per_s_vs_refreshes_png": wandb.Image(str(out / "tradeoff_time.png"))}
    for name, key, title in (("al_vs_refreshes", "acceptance_length", "AL vs refreshes per 1K tokens (replayed)"),
                             ("tokens_per_s_vs_refreshes", "modelled_tokens_per_s",
                              "modelled tokens/s vs refreshes per 1K tokens (replayed)")):
        xs, ys, keys = series(key, *LO_HI[key])
        logged[f"tradeoff/{name}"] = wandb.plot.line_series(xs=xs, ys=ys, keys=keys, title=title,
                                                            xname="refreshes per 1K tokens")
    if check:
        ccols = CHECK_COLUMNS
        logged["tradeoff/check"] = wandb.Table(columns=ccols, data=[[str(r[c]) if c == "knob" else r.get(c)
                                                                      for c in ccols] for r in check])
    run.log(logged)
    for scope, s in [("all", summary), *by_task.items()]:
        for fam, v in s.items():
            for stat in ("refresh_savings", "oracle_share", "al_gain"):
                run.summary[f"{scope}/{fam}/{stat}"] = v.get(stat)
                if v.get(f"{stat}_interval") is not None:
                    run.summary[f"{scope}/{fam}/{stat}_lo"], run.summary[f"{scope}/{fam}/{stat}_hi"] = \
                        v[f"{stat}_interval"]
    run.summary["full_cache_acceptance_length"] = rows[0]["acceptance_length"]
    run.summary.update({f"costs/{k}": v for k, v in costs.to_dict().items()})


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def span(iv, scale=100.0, fmt=".1f") -> str:
    return "" if iv is None else f" [{scale * iv[0]:{fmt}}, {scale * iv[1]:{fmt}}]"


def saving(s: dict) -> str:
    """A family's refresh savings at matched AL with its interval; "undefined" where periodic's curve is flat
    (``rift_ada.tradeoff.FLAT_GAIN``: no refresh rate of its matches an AL, so there is nothing to save against)."""
    if s.get("periodic_flat"):
        return "undefined (periodic refresh gains no AL here)"
    return f"{pct(s.get('refresh_savings'))}{span(s.get('refresh_savings_interval'))}"


def headline_line(fam: str, s: dict) -> str:
    """One family's replayed headline: savings at matched AL, share of the oracle's, AL gain; each with its
    interval (bootstrap over the held-out prompts)."""
    share = "" if fam == "oracle" or s.get("periodic_flat") else \
        f"; {pct(s.get('oracle_share'))}{span(s.get('oracle_share_interval'))} of the oracle's saving at that AL"
    gain = "n/a" if s.get("al_gain") is None else f"{s['al_gain']:+.3f}"
    return (f"{fam}: {saving(s)} fewer refreshes than "
            f"periodic at matched AL{share}; AL gain at matched refresh count {gain}"
            f"{span(s.get('al_gain_interval'), 1.0, '+.3f')}")


def print_summary(rows: list, summary: dict, by_task: dict, check: list, args, exported: dict,
                  session_s: float) -> None:
    seeds = f" x {args.eval_seeds} seeds" if args.eval_seeds > 1 else ""
    where = args.source_dir or "the standard library (held-out split)"
    print(f"\nreplayed on {args.eval_prompts} held-out prompts{seeds} from {where}; budget {args.budget}; "
          f"intervals: {100 * 0.95:.0f}% bootstrap over the prompts ({args.resamples} resamples)")
    print(f"{'family':>10} {'knob':>6} {'AL':>7} {'interval':>17} {'AL/full':>8} {'ref/1K':>8} {'tok/s*':>8}")
    for r in rows:
        iv = f"[{r['al_lo']:.2f}, {r['al_hi']:.2f}]"
        print(f"{r['family']:>10} {str(r['knob']):>6} {r['acceptance_length']:7.3f} {iv:>17} "
              f"{r['al_vs_full']:8.3f} {r['refreshes_per_1k']:8.2f} {r.get('modelled_tokens_per_s', 0.0):8.1f}")
    print("* tokens per second modelled with the measured costs (tradeoff_time.png)")
    for fam, s in summary.items():
        print(headline_line(fam, s))
    for task, s in by_task.items():
        print(f"  {task} prompts only: " + "; ".join(
            f"{fam} {saving(v)}"
            for fam, v in s.items()))
    if check:
        print(f"real decoder on the first {args.check_prompts} of them (same seeds at every point), against the "
              "replay of the same prompts:")
        for r in check:
            ok = "within" if r["al_within"] and r["refreshes_within"] else "OUTSIDE"
            print(f"  {r['family']:>10} {str(r['knob']):>6} AL {r['acceptance_length']:.3f} "
                  f"[{r['al_lo']:.3f}, {r['al_hi']:.3f}] (replayed {r['replayed_al']:.3f}), refreshes/1K "
                  f"{r['refreshes_per_1k']:.2f} [{r['refreshes_per_1k_lo']:.2f}, {r['refreshes_per_1k_hi']:.2f}] "
                  f"(replayed {r['replayed_refreshes_per_1k']:.2f}): replay {ok} the real interval")
    for fam, e in exported.items():
        print(f"exported {fam} (knob {e['knob']}) -> {e['file']}")
    print(f"this session {session_s:.0f} s")


def finish(out: Path, state, run, args, replay: Swept, check: Swept, learned: list, timings: dict, data: dict,
           costs, t_start: float) -> None:
    """The replayed comparison with intervals (pooled and per task family), the real decoder's check, one exported
    controller per ``learned`` kind (its best replayed point), and the report."""
    import time

    from rift_ada.resume import write_json

    rows, summary = replayed_tradeoff(replay, args, costs)
    tasks = args.task.split(",")
    by_task = {}
    if len(tasks) > 1:
        n = len(replay.counts[0]["per_prompt"]) // args.eval_seeds
        for f, task in enumerate(tasks):
            idx = [i for i in range(n) if i % len(tasks) == f]
            if idx:
                by_task[task] = replayed_tradeoff(replay, args, costs, idx)[1]
    checked = check_rows(check, replay, args)
    exported = {}
    for family in learned:
        best = best_of(rows, family)
        ctrl = next(p.controller for p in replay.points if p.family == family and p.knob == best["knob"])
        path = out / f"controller-{family}{ctrl.suffix}"
        ctrl.save(path)
        exported[family] = {"file": str(path), "knob": best["knob"]}
    timings["session_s"] = time.time() - t_start  # this session's wall time
    write_csv(out / "tradeoff.csv", rows, COLUMNS)
    write_csv(out / "tradeoff_check.csv", checked, CHECK_COLUMNS)
    title = (f"draft KV budget {args.budget}, {args.input_tokens}-token prompts, replayed on {args.eval_prompts} "
             f"held-out prompts\nbars: 95% bootstrap intervals over the prompts")
    plot(out / "tradeoff.png", rows, "acceptance_length", "acceptance length (tokens / target step)",
         title + (f"; squares: real decoder, {args.check_prompts} prompts" if checked else ""), checked, rows[0])
    plot(out / "tradeoff_time.png", rows, "modelled_tokens_per_s", "tokens / s (modelled)",
         f"{title}\nmodelled: draft step {1e3 * costs.draft_step_s:.2f} ms, verify {1e3 * costs.verify_s:.2f} ms, "
         f"refresh {1e3 * costs.refresh_s:.2f} ms", full=rows[0])
    # The modelled speed depends on the costs measured on this machine, so it stays out of tradeoff.csv (which a
    # resumed run reproduces bit for bit) and goes to metrics.json, the second plot and W&B.
    metrics = {"full_cache_acceptance_length": rows[0]["acceptance_length"], "rows": rows, "matched": summary,
               "by_task": by_task, "check": checked, "timings": timings, "exported": exported, "data": data,
               "reward": args.reward, "costs": costs.to_dict(),
               "intervals": {"level": 0.95, "resamples": args.resamples, "over": "held-out prompts"}}
    atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1, default=str)))
    log_to_wandb(run, out, rows, summary, by_task, checked, costs)
    run.summary.update({"session_seconds": timings["session_s"]})
    run.finish()
    write_json(state.path("done.json"), {"tradeoff": str(out / "tradeoff.csv")})
    print_summary(rows, summary, by_task, checked, args, exported, timings["session_s"])
