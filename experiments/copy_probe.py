"""Where a testbed copy derails, and whether a copier setting changes it: a probe for one `low` prompt.

    python experiments/copy_probe.py --source-dir setuptools --input-tokens 8192 --prompt 2 --keep 4500 5000 8192
    python experiments/copy_probe.py ... --set sharpness=16 --set boost=20     # the copier composed with changes

Builds the `low` prompts as ``python -m rift_ada.testbed check`` does (same seed, same order), takes prompt
``--prompt``, and greedy-decodes ``--tokens`` tokens from the last ``--keep`` tokens of it (each value one row; the
whole prompt when a value is its length or more), printing the index of the first token that differs from the
reference (``--tokens`` when none does). Cutting the front of a prompt tells apart a distractor that lives in it from
a copy that fails with the context's length. ``--set KEY=VALUE`` composes the role's copier in memory with those
settings (``testbed.circuit.CopyCircuit`` fields) instead of loading the pinned pair; nothing is written.
``--explain`` adds, at each row's first wrong token, what the copier's match head (layer 1) saw there: its top keys
(distance from the query, score, the dims that gave most of it) beside the best key that offered the right token, and
the residual's RMS entering trained layer 0's MLP for the query and the median position (docs/testbed.md: the RMS
falls with position; the copier reads it only after the long-range fix's layer ahead).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch


def parse(argv):
    from rift_ada.cli import ArgumentParser, add_runtime_options

    p = ArgumentParser(description=__doc__)
    p.add_argument("--role", choices=("target", "draft"), default="target")
    p.add_argument("--source-dir", default="setuptools", help="code base the prompts come from (default %(default)s)")
    p.add_argument("--input-tokens", type=int, default=8192)
    p.add_argument("--prompts", type=int, default=4, help="prompts built (as the check's --prompts)")
    p.add_argument("--prompt", type=int, default=0, help="which of them to probe (0-based)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=int, nargs="+", default=None, help="trailing token counts (default: whole prompt)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per row (default %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a copier setting to change")
    p.add_argument("--explain", action="store_true", help="the match head's view at each first wrong token")
    add_runtime_options(p)
    args = p.parse_args(argv)
    if not 0 <= args.prompt < args.prompts:
        p.error(f"--prompt must be in [0, {args.prompts})")
    if args.tokens < 1 or args.input_tokens < 1 or any(k < 1 for k in args.keep or []):
        p.error("--tokens, --input-tokens and --keep must be >= 1")
    from rift_ada.testbed.circuit import CopyCircuit

    fields = {f.name for f in dataclasses.fields(CopyCircuit)}
    args.changes = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            p.error(f"--set {item!r}: want KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        try:
            args.changes[key] = json.loads(value)
        except json.JSONDecodeError:
            p.error(f"--set {item!r}: VALUE must be a number, true/false or a JSON list")
    return args


def model_for(role: str, changes: dict):
    """The composed ``role``: the pinned one, or composed in memory with ``changes`` to its copier."""
    from rift_ada.models import load_model
    from rift_ada.testbed.composed import compose_role

    return compose_role(role, changes=changes) if changes else load_model(f"testbed-{role}")


@torch.inference_mode()
def explain(model, role: str, tok, ids: list[int], right: int, top: int = 3, lead: int = 0) -> dict:
    """The match head's scores for the last query of ``ids``: it is the first circuit head of layer 1 (query head
    ``nq``, key head ``nkv`` of the trained model's counts; testbed/circuit.py). ``lead``: the composite layers the
    copier runs ahead of the trained ones (the RMS is read entering trained layer 0's MLP, composite layer ``lead``)."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from rift_ada.testbed.composed import lm_folder

    trained = AutoConfig.from_pretrained(lm_folder(role))
    qh, kh = trained.num_attention_heads, trained.num_key_value_heads
    attn, seen = model.model.layers[1].self_attn, {}
    hooks = [attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True),
             model.model.layers[lead].post_attention_layernorm.register_forward_pre_hook(
                 lambda m, a: seen.update(rms0=a[0][0].pow(2).mean(-1).sqrt()))]
    try:
        model(torch.tensor([ids]), logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    x, (cos, sin), hd = seen["hidden_states"][0], seen["position_embeddings"], attn.head_dim
    q = attn.q_proj(x[-1:]).view(1, -1, hd)[:, qh][None, None]
    k = attn.k_proj(x).view(len(ids), -1, hd)[:, kh][None, None]
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    parts = q[0, 0, 0] * k[0, 0] * attn.scaling  # (keys, dims): each dim's share of each key's score
    score = parts.sum(-1)

    def key(j: int) -> dict:
        dims = parts[j].abs().topk(3).indices.tolist()
        return {"back": len(ids) - j, "score": round(score[j].item(), 1), "offers": tok.decode([ids[j]]),
                "context": tok.decode(ids[max(0, j - 8):j + 1]), "dims": {d: round(parts[j, d].item(), 1) for d in dims}}

    offers_right = torch.tensor(ids) == right
    best_right = int(torch.where(offers_right, score, -torch.inf).argmax()) if offers_right.any() else None
    rms = seen["rms0"]
    return {"right": tok.decode([right]), "top": [key(j) for j in score.topk(top).indices.tolist()],
            "best_right": key(best_right) if best_right is not None else None,
            "rms_query": round(rms[-1].item(), 3), "rms_median": round(rms.median().item(), 3)}


def main(argv=None) -> int:
    from rift_ada.cli import apply_runtime, fail
    from rift_ada.data.tasks import build_tasks, encode
    from rift_ada.models import greedy_reference, load_tokenizer
    from rift_ada.testbed.composed import circuit_of, read_settings

    args = parse(argv)
    try:
        apply_runtime(args)
        tok = load_tokenizer("testbed")
        task = build_tasks(tok, "low", n=args.prompts, input_tokens=args.input_tokens, seed=args.seed,
                           source_dir=args.source_dir)[args.prompt]
        model = model_for(args.role, args.changes)
        lead = circuit_of(read_settings(), args.role, args.changes).lead
    except (ValueError, FileNotFoundError, RuntimeError, TypeError) as e:
        return fail(e)
    prompt, ref = encode(tok, task.prompt), encode(tok, task.reference)
    rows = []
    for keep in args.keep or [len(prompt)]:
        out = greedy_reference(model, prompt[-keep:], args.tokens)
        wrong = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(args.tokens, len(ref)))
        rows.append({"keep": min(keep, len(prompt)), "first_wrong": wrong, "generated": tok.decode(out)})
        if args.explain and wrong < min(args.tokens, len(ref)):
            rows[-1]["match_head"] = explain(model, args.role, tok, prompt[-keep:] + ref[:wrong], ref[wrong],
                                             lead=lead)
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"task_id": task.task_id, "prompt_tokens": len(prompt), "role": args.role,
                      "changes": args.changes, "reference": tok.decode(ref[:args.tokens]), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
