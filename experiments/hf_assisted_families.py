"""Which model families HF assisted generation decodes exactly, and rift-ada's ``generate`` method beside it.

    python experiments/hf_assisted_families.py --output experiments/results/hf-assisted-families.json

For every family of ``rift_ada.architectures.FAMILIES`` as a tiny random-init target (sliding windows of 16 tokens,
80-token prompts, so windows are full when drafts are rejected) and a 2-layer Llama draft, greedy: the target's own
``generate``, then ``generate(assistant_model=draft)`` (HF assisted generation, k draft tokens a round), then
``generate(custom_generate=rift_generate)`` with rift-dyn (budget 24, refresh every 8 tokens). Each is "exact"
(the target's own tokens), "differs at token i", or "refused: <the error's first line>". Greedy speculative decoding
must give the target's tokens, so any difference is a decoding error. No EOS stops a run (random models emit their
EOS id early), so every run decodes all --new-tokens.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from rift_ada.architectures import FAMILIES, family
from rift_ada.studies.decode_bench import generate_tokens, shared_prefix
from rift_ada.hf import rift_generate
from rift_ada.models import assisted_reference, first_line, greedy_reference


def outcome(run, reference: list[int]) -> str:
    try:
        tokens = run()
    except Exception as e:  # noqa: BLE001 - the point is to record what each path does
        return f"refused: {first_line(e)}"
    same = shared_prefix(tokens, reference)
    return "exact" if same == len(tokens) == len(reference) else f"differs at token {same}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=80)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--seeds", type=int, default=3, help="random prompts per family")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    draft = family("llama").model(seed=1, layers=2)
    rows = []
    for fam in FAMILIES:
        target = fam.model(seed=0, window=args.window)
        row = {"family": fam.key, "stateful": bool(target._is_stateful), "hf_assisted": [], "rift_generate": []}
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(seed)
            prompt = torch.randint(0, 128, (args.prompt_tokens,), generator=gen).tolist()
            ref = greedy_reference(target, prompt, args.new_tokens)
            row["hf_assisted"].append(outcome(
                lambda: assisted_reference(target, draft, prompt, args.new_tokens, args.draft_length), ref))
            key = "rift_draft" if row["stateful"] else "assistant_model"  # generate refuses assistant_model there
            row["rift_generate"].append(outcome(lambda: generate_tokens(
                target, prompt, args.new_tokens, None, custom_generate=rift_generate, rift_policy="rift-dyn",
                rift_budget=24, rift_period=8, rift_draft_length=args.draft_length, rift_layout={"obs_window": 8},
                **{key: draft}), ref))
        rows.append(row)
        print(f"| {fam.key} | {'; '.join(sorted(set(row['hf_assisted'])))} | "
              f"{'; '.join(sorted(set(row['rift_generate'])))} |", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"options": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
