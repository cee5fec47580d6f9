"""Held-out evaluation of a compressibility-trained draft: acceptance lengths (AL, ``rift_ada.metrics``) of the
untrained and the trained drafter on prompts training never saw, with the full cache and with RIFT at fractions of the
input. ``experiments/train_compressibility.py`` makes its table with :func:`evaluate_table` (one resumable unit per
row) and its in-run curve with :func:`curve_point`.

Under torchrun every process calls these with the same arguments: ``rift_ada.evaluate.evaluate`` shards the prompts
across the processes and gathers, and the table's units are collective (``RunState(..., collective=True)``).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from statistics import mean

import torch
from tqdm.auto import tqdm

from rift_ada import distributed
from rift_ada.metrics import acceptance_length

TABLE_COLUMNS = ("prompts", "temperature", "policy", "budget_fraction", "budget", "al_untrained", "al_trained",
                 "relative_change", "change_low", "change_high")
BOOTSTRAP = 2000  # resamples of the prompts for the relative change's 95% interval


@dataclass(frozen=True)
class HeldOut:
    """How the held-out prompts are built and decoded (the script's evaluation options)."""

    task: str  # task family of the held-out prompts
    prompts: int  # prompts per table row and prompt set
    input_tokens: int
    new_tokens: int
    draft_length: int
    period: int  # RIFT-dyn re-selection period
    budgets: tuple[float, ...]  # fractions of the input
    temperatures: tuple[float, ...]  # the table's
    seed: int

    def key(self) -> dict:
        """What a stored table row depends on beyond its name (a rerun with other values recomputes it)."""
        return {"eval_prompts": self.prompts, "eval_new_tokens": self.new_tokens, "draft_length": self.draft_length,
                "eval_task": self.task, "row_format": 2}  # 2: per-prompt ALs and the change's interval


def eval_prompts(tokenizer, cfg: HeldOut, source_dir: str | None = None) -> list[list[int]]:
    """Held-out prompts: the standard library's eval split (``source_dir`` None) or a code base's files."""
    from rift_ada.data import build_tasks, encode_prompts

    return encode_prompts(tokenizer, build_tasks(tokenizer, cfg.task, n=cfg.prompts, input_tokens=cfg.input_tokens,
                                                 seed=cfg.seed, source_dir=source_dir,
                                                 split=None if source_dir else "eval"))


def eval_drafter(drafter, target=None):
    """(model, draft step): the drafter as evaluation runs it: an external drafter's adapter merged into a copy (the
    same function: LoRA adds B @ A to each weight); a self-drafter's (one built on ``target`` itself) as users run it,
    switched on in the draft passes alone; on the static draft step where the model supports it (2-3x faster on a
    CPU; the same tokens)."""
    from rift_ada.architectures import UnsupportedModelError
    from rift_ada.lora import shares_weights
    from rift_ada.static import check_static

    model = drafter
    if hasattr(drafter, "merge_and_unload") and not shares_weights(drafter, target):
        model = copy.deepcopy(drafter).merge_and_unload()
        model.eval()
    try:
        check_static(model, "draft")
        return model, "static"
    except UnsupportedModelError:  # another family, or sliding / hybrid layers: its own forward
        return model, "model"


def budget_tokens(prompts, fraction: float) -> int:
    """A budget given as a fraction of the prompts' mean length, in tokens (at least 2)."""
    return max(2, round(fraction * sum(len(x) for x in prompts) / len(prompts)))


def heldout_acceptance(pair, drafter, prompts, policy_name: str, budget: int | None, temperature: float,
                       cfg: HeldOut) -> float:
    """AL of ``drafter`` (from :func:`eval_drafter`) under a named policy: per prompt, then the mean over prompts."""
    return mean(heldout_als(pair, drafter, prompts, policy_name, budget, temperature, cfg))


def heldout_als(pair, drafter, prompts, policy_name: str, budget: int | None, temperature: float,
                cfg: HeldOut) -> list[float]:
    """AL of ``drafter`` (from :func:`eval_drafter`) under a named policy, per prompt."""
    from rift_ada.evaluate import evaluate
    from rift_ada.policies import make_policy
    from rift_ada.speculative import Decoding, SpeculativeDecoder

    policy = make_policy(policy_name, budget=budget, period=cfg.period if policy_name == "rift-dyn" else None)
    model, step = drafter
    dec = SpeculativeDecoder.for_pair(pair, policy.layout, Decoding(cfg.draft_length, temperature, seed=cfg.seed,
                                                                    draft_step=step), model)
    with torch.inference_mode():
        results = evaluate(dec, prompts, policy.controller, cfg.new_tokens).results
    return [acceptance_length(r.rounds) for r in results]


def change_interval(untrained: list[float], trained: list[float], seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(trained) / mean(untrained) - 1, the prompts resampled in pairs (a percentile bootstrap:
    a prompt's two ALs share its text, so they move together)."""
    a, b = torch.tensor(untrained, dtype=torch.float64), torch.tensor(trained, dtype=torch.float64)
    idx = torch.randint(0, len(a), (BOOTSTRAP, len(a)), generator=torch.Generator().manual_seed(seed))
    ratios = b[idx].mean(1) / a[idx].mean(1) - 1
    return float(ratios.quantile(0.025)), float(ratios.quantile(0.975))


def curve_point(pair, drafter, prompts, cfg: HeldOut, temperature: float) -> dict:
    """The in-run curve's point: AL of the drafter as it stands, full cache, rift-stat and rift-dyn at each of
    ``cfg.budgets``."""
    from rift_ada.lora import AdapterSwitch, shares_weights

    d = eval_drafter(drafter, pair.target)
    point = {"al_full": heldout_acceptance(pair, d, prompts, "full", None, temperature, cfg)}
    for frac in cfg.budgets:
        for pol in ("rift-stat", "rift-dyn"):
            point[f"al_{pol.replace('-', '_')}_{frac:g}"] = heldout_acceptance(pair, d, prompts, pol,
                                                                               budget_tokens(prompts, frac),
                                                                               temperature, cfg)
    if shares_weights(drafter, pair.target):  # a decoder leaves a self-drafter's adapter off: training goes on
        AdapterSwitch(drafter).set(True)
    return point


def evaluate_table(pair, drafters: dict, prompts, cfg: HeldOut, state, name: str = "stdlib-eval") -> list[dict]:
    """The table's rows for one prompt set (``name``): AL of ``drafters["untrained"]`` and ``["trained"]`` (from
    :func:`eval_drafter`) for every temperature, policy and budget; each row a unit of ``state`` (a RunState)."""
    configs = [("full", None)] + [(pol, frac) for frac in cfg.budgets for pol in ("rift-stat", "rift-dyn")]

    def row(temp, pol_name, frac):
        budget = None if frac is None else budget_tokens(prompts, frac)
        als = {label: heldout_als(pair, d, prompts, pol_name, budget, temp, cfg) for label, d in drafters.items()}
        al = {label: mean(v) for label, v in als.items()}
        low, high = change_interval(als["untrained"], als["trained"])
        return {"prompts": name, "temperature": temp, "policy": pol_name, "budget_fraction": frac, "budget": budget,
                "al_untrained": al["untrained"], "al_trained": al["trained"],
                "relative_change": al["trained"] / al["untrained"] - 1, "change_low": low, "change_high": high,
                "al_untrained_prompts": als["untrained"], "al_trained_prompts": als["trained"]}

    todo = [(temp, pol, frac) for temp in cfg.temperatures for pol, frac in configs]
    # The prompts themselves are part of a row's key: a rerun with another --source-dir recomputes its rows.
    sha = hashlib.sha256(repr([list(map(int, p)) for p in prompts]).encode()).hexdigest()
    key = {**cfg.key(), "prompts_sha256": sha}
    rows = [state.unit(f"eval-{name}-t{temp:g}-{pol}-{'full' if frac is None else f'{frac:g}'}",
                       lambda temp=temp, pol=pol, frac=frac: row(temp, pol, frac), key)
            for temp, pol, frac in tqdm(todo, desc=f"evaluation ({name})", disable=not distributed.is_main())]
    return [{c: r[c] for c in TABLE_COLUMNS + ("al_untrained_prompts", "al_trained_prompts")} for r in rows]


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| prompts | temperature | policy | budget | AL untrained | AL trained | change [95% over prompts] |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        budget = "full" if r["budget"] is None else f"{r['budget']} ({100 * r['budget_fraction']:.1f}%)"
        lines.append(f"| {r['prompts']} | {r['temperature']:g} | {r['policy']} | {budget} | {r['al_untrained']:.3f} | "
                     f"{r['al_trained']:.3f} | {100 * r['relative_change']:+.1f}% [{100 * r['change_low']:+.1f}, "
                     f"{100 * r['change_high']:+.1f}] |")
    return "\n".join(lines)


def write_results(out, results: dict, run) -> str:
    """``results`` (its ``rows`` the table's) to ``out/results.json`` and ``out/table.md``, the table and the timings to
    the W&B ``run`` (a ``ResumableRun``, then finished); returns the table as Markdown."""
    import wandb

    from rift_ada.resume import write_json

    table = format_table(results["rows"])
    write_json(out / "results.json", results)
    (out / "table.md").write_text(table + "\n")
    data = [[r[c] for c in TABLE_COLUMNS] for r in results["rows"]]
    run.log({"compressibility/table": wandb.Table(columns=list(TABLE_COLUMNS), data=data)})
    run.summary.update({"train_seconds": results["train_seconds"], "total_seconds": results["total_seconds"]})
    run.finish()
    return table
