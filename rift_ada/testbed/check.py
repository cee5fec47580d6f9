"""How well a target and its draft retrieve: greedy copy accuracy and teacher-forced draft/target agreement."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..data.tasks import Task, encode
from ..models import check_vocab


def check_fits(model, n_tokens: int, what: str = "prompt + generation") -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and n_tokens > limit:
        raise ValueError(f"{what} needs {n_tokens} positions but the model's context is {limit} tokens; "
                         "use shorter prompts or fewer new tokens")


@torch.inference_mode()
def greedy_continuation(model, prompt_ids: list[int], new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """The model's own greedy output via HF ``generate`` (the reference every speculative run must reproduce)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0,
                         top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()


def copy_accuracy(generated: list[int], reference: list[int], n: int) -> float:
    """Share of the first ``n`` reference tokens that the generation reproduces at the same position."""
    n = min(n, len(reference))
    return sum(g == r for g, r in zip(generated[:n], reference[:n])) / n


@torch.inference_mode()
def agreement(target, draft, prompt_ids: list[int], reference: list[int], n: int) -> float:
    """Teacher-forced top-1 agreement of draft and target on the positions that predict the reference."""
    n = min(n, len(reference))
    ids = torch.tensor([prompt_ids + reference[:n]], device=target.device)
    # The last n+1 positions; the first n of them predict reference[0..n-1].
    t = target(ids, logits_to_keep=n + 1).logits[0, :n].argmax(-1)
    d = draft(ids, logits_to_keep=n + 1).logits[0, :n].argmax(-1)
    return (t == d).float().mean().item()


def run_check(target, draft, tokenizer, tasks: list[Task], new_tokens: int = 256, progress: bool = True) -> dict:
    check_vocab(target, draft)
    rows = []
    for task in tqdm(tasks, desc="testbed check", disable=not progress):
        prompt, ref = encode(tokenizer, task.prompt), encode(tokenizer, task.reference)
        if not ref:
            raise ValueError(f"task {task.task_id!r} has no reference continuation to score against")
        for m in (target, draft):
            check_fits(m, len(prompt) + max(new_tokens, 1))
        rows.append({
            "task_id": task.task_id,
            "prompt_tokens": len(prompt),
            "target_copy_accuracy": copy_accuracy(greedy_continuation(target, prompt, new_tokens), ref, new_tokens),
            "draft_copy_accuracy": copy_accuracy(greedy_continuation(draft, prompt, new_tokens), ref, new_tokens),
            "draft_agreement": agreement(target, draft, prompt, ref, new_tokens),
        })
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    return {
        "target_copy_accuracy": mean("target_copy_accuracy"),
        "draft_copy_accuracy": mean("draft_copy_accuracy"),
        "draft_agreement": mean("draft_agreement"),
        "prompts": len(rows),
        "mean_prompt_tokens": mean("prompt_tokens"),
        "new_tokens": new_tokens,
        "per_prompt": rows,
    }
