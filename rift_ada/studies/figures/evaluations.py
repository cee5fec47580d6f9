"""The evaluations every figure draws from: the loaded models, the prompt sets, and each setting evaluated once.

A setting that two figures share (e.g. rift-stat at 25% is in figures 1, 2, 3 and 4) is evaluated once: the cache
is keyed by the draft, the prompt set, the layout and the controller (a kind the sweeps vary is built from its knob
alone, so its repr names it; any other controller, e.g. one loaded from a file, is keyed by the object).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from rift_ada.cli import decoding_from_args, policy_from_args, tasks_from_args
from rift_ada.policies import POLICIES

DEFAULT_RULE = ("acc_mean", "<", 0.5)  # rift-ada's controller when no --controller is given


def default_budget(input_size: int) -> int:
    return max(2, round(0.25 * input_size))


@dataclass
class EvaluationCache:
    """The loaded models, prompt sets and evaluations of a run; a setting evaluated once is reused by every figure."""

    args: argparse.Namespace
    pair: object
    drafts: dict  # "untrained" / "trained" -> the draft model
    prompts: dict  # prompt set name -> encoded prompts ("main": figures 1, 2, 4; "len-N": figure 3)
    input_size: int  # the input length budgets are fractions of
    budget: int  # figures 1, 3 and 4
    cache: dict = field(default_factory=dict)
    costs: object = None  # rift_ada.costs.CostModel (rank 0; figure 4)
    _ada: object = None

    def policy(self, name: str, budget: int | None = None, controller=None, period: int | None = None):
        return policy_from_args(self.args, name, budget=self.budget if budget is None else budget,
                                period=(period or self.args.period) if name == "rift-dyn" else None,
                                controller=controller if name == "rift-ada" else None)

    def budget_of(self, fraction: float) -> int:
        return max(2, round(fraction * self.input_size))

    def check(self) -> None:
        """Every figure's cache settings are valid (ValueError otherwise): checked before anything slow."""
        for name in POLICIES:
            self.policy(name, controller=self.rift_ada_controller())
        for frac in self.args.budgets:
            self.policy("rift-stat", self.budget_of(frac))

    def rift_ada_controller(self):
        """rift-ada's controller in figures 1, 3 and 4: the first --controller, else the threshold rule (one object,
        so its evaluations are shared)."""
        from rift_ada.refresh import ThresholdController, parse_controller

        if self._ada is None:
            self._ada = parse_controller(self.args.controllers[0]) if self.args.controllers else ThresholdController(
                [DEFAULT_RULE])
        return self._ada

    def decoder(self, layout, drafter: str = "untrained", **decoding):
        """A decoder of the pair with ``layout`` and one of the drafts (``decoding``: settings other than the
        options')."""
        from rift_ada.speculative import SpeculativeDecoder

        return SpeculativeDecoder.for_pair(self.pair, layout, decoding_from_args(self.args, **decoding),
                                           self.drafts[drafter])

    def evaluate(self, policy, drafter: str = "untrained", prompts: str = "main", label: str = ""):
        """``rift_ada.evaluate.evaluate`` of ``policy`` with one of the drafts on one prompt set (memoised)."""
        from rift_ada.evaluate import evaluate

        ctrl = policy.controller
        by_value = ctrl is None or ctrl.knob is not None
        # the same prompt list (figure 3's set at --input-tokens is the main set), layout and rule: the same run
        key = (drafter, id(self.prompts[prompts]), repr(policy.layout), repr(ctrl) if by_value else id(ctrl))
        if key not in self.cache:
            self.cache[key] = evaluate(self.decoder(policy.layout, drafter), self.prompts[prompts], ctrl,
                                       self.args.max_new_tokens, progress=label or policy.name)
        return self.cache[key]


def prompt_sets(args, tokenizer) -> tuple[dict, int]:
    """The prompt sets (encoded) and the input size budgets are fractions of."""
    from rift_ada.data import encode_prompts

    sets = {"main": encode_prompts(tokenizer, tasks_from_args(args, tokenizer))}
    built = not (args.data or args.speedbench)
    size = args.input_tokens if built else round(sum(map(len, sets["main"])) / len(sets["main"]))
    if built:
        for n in args.input_lengths:
            sets[f"len-{n}"] = sets["main"] if n == args.input_tokens else encode_prompts(
                tokenizer, tasks_from_args(argparse.Namespace(**{**vars(args), "input_tokens": n}), tokenizer))
    else:  # prompts from a file: grouped by length, (previous length, n]
        lo = 0
        for n in sorted(args.input_lengths):
            sets[f"len-{n}"] = [p for p in sets["main"] if lo < len(p) <= n]
            lo = n
        if not any(sets[f"len-{n}"] for n in args.input_lengths):
            raise ValueError(f"no prompt is up to {max(args.input_lengths)} tokens long: raise --input-lengths")
    return sets, size


def check_positions(pair, sets: dict, args) -> None:
    limit = min(getattr(m.config, "max_position_embeddings", None) or 10**9 for m in (pair.target, pair.draft))
    for name, prompts in sets.items():
        longest = max(map(len, prompts), default=0)
        if longest + args.max_new_tokens + args.draft_length + 1 > limit:
            what = "--input-lengths" if name.startswith("len-") else "--input-tokens"
            raise ValueError(f"{what}: prompts of up to {longest} tokens + {args.max_new_tokens} new tokens exceed the "
                             f"models' {limit} positions (max_position_embeddings); use shorter prompts")
