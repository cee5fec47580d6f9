"""The paper's regime (long inputs, long outputs, one token budget) measured on replay tables: decode staleness by
generation position, retention against the full cache, acceptance length (AL) by budget, and the refresh tradeoff.
``experiments/paper_regime.py`` builds the tables and writes what this computes.

Every number is a replay (``rift_ada.replay``): exact for greedy decoding where no refresh scores a history the
decoder computed differently (and always for caches that never refresh), the expectation over the rejection rule's
coin flips when sampling (``episodes`` replays per table). Intervals are 95% percentile bootstraps over prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..refresh import PeriodicController
from ..replay.fixed import al_by_position
from ..replay.process import full_table, table_replays

STALENESS = ("full", "snapkv", "window", "rift-stat", "rift-dyn")


def regime_prompts(tokenizer, opts: dict) -> list[list[int]]:
    """The token ids of a run's prompts from its options (``experiments/paper_regime.py``'s, as its argparse namespace
    or its ``summary.json`` holds them): ``prompts`` of ``task`` from ``source_dir``, each copying a file of up to
    ``reference_tokens`` (at least half as many)."""
    from ..data import build_task_mix, encode_prompts

    ref = {"reference_tokens": opts["reference_tokens"], "min_reference_tokens": opts["reference_tokens"] // 2}
    return encode_prompts(tokenizer, build_task_mix(tokenizer, opts["task"], opts["prompts"], opts["input_tokens"],
                                                    opts["seed"], None, source_dir=opts["source_dir"], **ref))


def table_name(index: int, ids) -> str:
    """A run's table of prompt ``index`` (the file stem in :func:`tables_folder`): its order and its tokens' hash."""
    from ..replay.build import prompt_sha

    return f"p{index:03d}-{prompt_sha(ids)}"


def tables_folder(out, temperature: float):
    """Where a run in ``out`` keeps its tables at ``temperature``."""
    return Path(out) / f"tables-t{temperature:g}"

@dataclass
class Setting:
    """One temperature and drafter: the tables per prompt at the main budget, the caches that never refresh over the
    same continuations, and rift tables at other budgets."""

    temperature: float
    drafter: str  # "external" or "self"
    main: list
    fixed: dict = field(default_factory=dict)  # "snapkv" / "window" -> tables
    budgets: dict = field(default_factory=dict)  # budget -> tables (the main budget's are ``main``)

    @property
    def label(self) -> str:
        return f"T={self.temperature:g}, {self.drafter}"


@dataclass(frozen=True)
class Replays:
    """How replays run: k, sampling replays per table, seed, bin width, resamples, the rift-dyn period."""

    k: int = 11
    episodes: int = 16
    seed: int = 0
    width: int = 256
    resamples: int = 1000
    period: int = 256


def policy_runs(s: Setting, policy: str, r: Replays, budget: int | None = None) -> list[list]:
    """A staleness policy's replays: the full cache, a cache that never refreshes, or rift (never refreshed: stat;
    every ``r.period`` tokens: dyn) at the main budget or ``budget``."""
    if policy == "full":
        tables = [full_table(t) for t in s.main]
    elif policy in ("snapkv", "window"):
        tables = s.fixed[policy]
    else:
        tables = s.main if budget is None else s.budgets[budget]
    return table_replays(tables, PeriodicController(r.period) if policy == "rift-dyn" else None, r.k, r.episodes,
                         r.seed)


def interval(values, r: Replays, ratio_to=None):
    """Percentile bootstrap over prompts of the mean of ``values`` (over the mean of ``ratio_to``, when given);
    None with fewer than 2 prompts."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return None
    rng = np.random.default_rng(r.seed)
    idx = rng.integers(0, len(v), size=(r.resamples, len(v)))
    with np.errstate(invalid="ignore"):
        draws = np.nanmean(v[idx], 1)
        if ratio_to is not None:
            draws = draws / np.nanmean(np.asarray(ratio_to, dtype=np.float64)[idx], 1)
    draws = draws[~np.isnan(draws)]
    return None if len(draws) == 0 else tuple(float(x) for x in np.percentile(draws, [2.5, 97.5]))


def per_prompt(episodes: list[list]) -> dict:
    """A policy's numbers per prompt: AL (mean over replays), refreshes and tokens (mean over replays)."""
    return {"al": [float(np.mean([e.acceptance_length() for e in eps])) for eps in episodes],
            "refreshes": [float(np.mean([e.refreshes for e in eps])) for eps in episodes],
            "tokens": [float(np.mean([e.g for e in eps])) for eps in episodes]}


def _row(base: dict, al: list, full: list, refreshes: list, tokens: list, r: Replays) -> dict:
    lo_hi = interval(al, r)
    ratio = interval(al, r, ratio_to=full)
    return {**base, "prompts": len(al), "acceptance_length": float(np.mean(al)),
            "al_lo": lo_hi and lo_hi[0], "al_hi": lo_hi and lo_hi[1],
            "al_vs_full": float(np.mean(al) / np.mean(full)), "vs_full_lo": ratio and ratio[0],
            "vs_full_hi": ratio and ratio[1], "refreshes_per_1k": 1000 * sum(refreshes) / sum(tokens),
            "per_prompt_al": [round(x, 4) for x in al]}


def staleness(settings: list[Setting], r: Replays) -> tuple[list[dict], list[dict]]:
    """(rows per setting, policy and ``r.width``-token bin of the generation; rows per setting and policy over the
    whole generation, with AL against the same draft's full cache)."""
    bins, whole = [], []
    for s in settings:
        n = int(s.main[0].header["max_new_tokens"])
        full = None
        for policy in STALENESS:
            if policy in ("snapkv", "window") and policy not in s.fixed:
                continue
            eps = policy_runs(s, policy, r)
            pp = per_prompt(eps)
            full = pp["al"] if policy == "full" else full
            base = {"temperature": s.temperature, "drafter": s.drafter, "policy": policy}
            whole.append(_row(base, pp["al"], full, pp["refreshes"], pp["tokens"], r))
            by_bin = np.array([al_by_position(e, r.width, n) for e in eps])  # (prompts, bins)
            for b in range(by_bin.shape[1]):
                col = by_bin[:, b]
                iv = interval(col, r)
                with np.errstate(invalid="ignore"):
                    bins.append({**base, "bin_start": b * r.width, "bin_end": min((b + 1) * r.width, n),
                                 "acceptance_length": float(np.nanmean(col)) if not np.isnan(col).all() else None,
                                 "al_lo": iv and iv[0], "al_hi": iv and iv[1]})
    return bins, whole


def by_budget(settings: list[Setting], main_budget: int, r: Replays) -> list[dict]:
    """AL of rift-stat and rift-dyn at every budget (the external draft's settings), against the full cache."""
    rows = []
    for s in settings:
        if s.drafter != "external" or not s.budgets:
            continue
        full = per_prompt(policy_runs(s, "full", r))["al"]
        for budget in sorted([main_budget, *s.budgets]):
            for policy in ("rift-stat", "rift-dyn"):
                pp = per_prompt(policy_runs(s, policy, r, None if budget == main_budget else budget))
                rows.append(_row({"temperature": s.temperature, "drafter": s.drafter, "policy": policy,
                                  "budget": budget}, pp["al"], full, pp["refreshes"], pp["tokens"], r))
    return rows


def staleness_statement(bins: list[dict], s: Setting) -> str:
    """Whether SnapKV's prefill selection loses its lead over the sliding window as generation proceeds, in numbers."""
    def curve(policy):
        return [b["acceptance_length"] for b in bins if b["policy"] == policy and b["temperature"] == s.temperature
                and b["drafter"] == s.drafter]

    snap, win = curve("snapkv"), curve("window")
    if not snap or not win:
        return f"{s.label}: no snapkv / window rows"
    lead = [None if a is None or b is None else a - b for a, b in zip(snap, win)]
    first, last = lead[0], lead[-1]
    verdict = ("loses its lead" if first is not None and last is not None and first > 0 and last < first / 2
               else "keeps its lead" if first is not None and first > 0 else "never leads")
    cells = ", ".join("-" if x is None else f"{x:+.2f}" for x in lead)
    return f"{s.label}: SnapKV prefill-only minus window, AL per bin: {cells} -> {verdict}"


def plot_staleness(path, bins: list[dict], settings: list[Setting], width: int) -> None:
    """One panel per setting: each policy's AL per bin, its interval shaded."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 4), squeeze=False)
    for ax, s in zip(axes[0], settings):
        for policy in STALENESS:
            rs = [b for b in bins if (b["temperature"], b["drafter"], b["policy"]) == (s.temperature, s.drafter,
                                                                                         policy)]
            if not rs:
                continue
            x = [(b["bin_start"] + b["bin_end"]) / 2 for b in rs]
            y = [np.nan if b["acceptance_length"] is None else b["acceptance_length"] for b in rs]
            line, = ax.plot(x, y, marker="o", ms=3, label=policy, **({"ls": "--", "color": "grey"}
                                                                      if policy == "full" else {}))
            if all(b["al_lo"] is not None for b in rs):
                ax.fill_between(x, [b["al_lo"] for b in rs], [b["al_hi"] for b in rs], alpha=0.15,
                                color=line.get_color())
        ax.set_title(s.label, fontsize=9)
        ax.set_xlabel(f"generation position (tokens; bins of {width})")
        ax.set_ylabel("acceptance length")
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_budgets(path, rows: list[dict], whole: list[dict]) -> None:
    """AL against budget for rift-stat and rift-dyn per temperature, the full cache's AL dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for temp in dict.fromkeys(r["temperature"] for r in rows):
        for policy in ("rift-stat", "rift-dyn"):
            rs = sorted((r for r in rows if r["temperature"] == temp and r["policy"] == policy),
                        key=lambda r: r["budget"])
            yerr = None
            if all(r["al_lo"] is not None for r in rs):
                yerr = [[r["acceptance_length"] - r["al_lo"] for r in rs], [r["al_hi"] - r["acceptance_length"]
                                                                             for r in rs]]
            ax.errorbar([r["budget"] for r in rs], [r["acceptance_length"] for r in rs], yerr=yerr, marker="o",
                        capsize=2, label=f"{policy}, T={temp:g}")
        full = [w for w in whole if w["temperature"] == temp and w["drafter"] == "external" and w["policy"] == "full"]
        if full:
            ax.axhline(full[0]["acceptance_length"], ls="--", color="grey", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft cache budget (tokens)")
    ax.set_ylabel("acceptance length (dashed: full cache)")
    ax.legend(fontsize=7)
    _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> None:
    from ..resume import atomic_write

    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    _pyplot().close(fig)
