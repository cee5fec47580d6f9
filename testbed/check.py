"""How well a target and its draft retrieve: greedy copy accuracy and teacher-forced draft/target agreement."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rift_ada.data.tasks import FILE_HEADER, Task, encode
from rift_ada.models import check_fits, check_vocab, greedy_reference


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


@dataclass
class Decoded:
    """One model on one prompt: its greedy tokens, its teacher-forced top-1 on the positions that predict the
    reference, and what the prefill and each greedy step cost."""
    greedy: list[int]
    forced: torch.Tensor
    prefill_s: float
    step_s: float


@torch.inference_mode()
def decode_once(model, prompt_ids: list[int], reference: list[int], n: int) -> Decoded:
    """Greedy decoding of ``n`` tokens and the teacher-forced top-1 over ``reference[:n]`` from one prefill: the
    forced pass runs on the prefilled cache, which is then cropped back to the prompt for the greedy steps. At 32K
    tokens the prefill is most of a prompt's cost, so it is not paid twice. The greedy steps run on
    ``rift_ada.static``'s static cache where the model allows it (transformers' dynamic cache copies itself every
    step: 2.1 s a target step at 32K against 0.17), else on the model's own cache; either is argmax, one token a
    step."""
    from transformers import DynamicCache

    from rift_ada.architectures import UnsupportedModelError
    from rift_ada.static import StaticVerify, check_static

    n = min(n, len(reference))
    dev = model.device
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    first = model(torch.tensor([prompt_ids], device=dev), cache=cache, use_cache=True,
                  logits_to_keep=1).logits[0, -1].argmax()
    prefill_s = time.perf_counter() - t0
    forced = [first]
    if n > 1:
        forced.extend(model(torch.tensor([reference[:n - 1]], device=dev), cache=cache,
                            use_cache=True).logits[0].argmax(-1))
        cache.crop(-(n - 1))  # back to the prompt (transformers 5: a negative count removes that many tokens)
    try:
        check_static(model, "target")
        step = StaticVerify(model, 1)
        cache = step.cache(cache, len(prompt_ids) + n + 1)
    except UnsupportedModelError:
        step = None
    out, tok = [int(first)], first.view(1, 1)
    t0 = time.perf_counter()
    for _ in range(n - 1):
        if step is None:
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        else:
            tok = step(cache, [out[-1]])[-1].argmax()
        out.append(int(tok))
    step_s = (time.perf_counter() - t0) / max(n - 1, 1)
    return Decoded(out, torch.stack([torch.as_tensor(f) for f in forced]), prefill_s, step_s)


def run_check(target, draft, tokenizer, tasks: list[Task], new_tokens: int = 256, progress: bool = True,
              high_tasks: list[Task] | None = None, sort_tasks: list[Task] | None = None,
              code_windows: list[list[int]] | None = None) -> dict:
    """Copy accuracy and agreement on ``tasks``; optionally agreement on ``high_tasks``, the target's greedy accuracy
    on ``sort_tasks`` and teacher-forced top-1 / NLL of both models on plain-code ``code_windows``. ``costs``: the
    mean prefill seconds and greedy step milliseconds of each model on ``tasks``."""
    check_vocab(target, draft)
    bar = tqdm(total=len(tasks) + len(high_tasks or []) + len(sort_tasks or []) + (1 if code_windows else 0),
               desc="testbed check", disable=not progress)
    rows, costs = [], []
    for task in tasks:
        prompt, ref = _encode_task(tokenizer, task, (target, draft), new_tokens)
        t, d = (decode_once(m, prompt, ref, new_tokens) for m in (target, draft))
        rows.append({
            "task_id": task.task_id,
            "prompt_tokens": len(prompt),
            "target_copy_accuracy": copy_accuracy(t.greedy, ref, new_tokens),
            "draft_copy_accuracy": copy_accuracy(d.greedy, ref, new_tokens),
            "draft_agreement": (t.forced == d.forced).float().mean().item(),
        })
        costs.append({"target_prefill_s": t.prefill_s, "draft_prefill_s": d.prefill_s,
                      "target_step_ms": 1e3 * t.step_s, "draft_step_ms": 1e3 * d.step_s})
        bar.update(1)
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    result = {
        "target_copy_accuracy": mean(rows, "target_copy_accuracy"),
        "draft_copy_accuracy": mean(rows, "draft_copy_accuracy"),
        "draft_agreement": mean(rows, "draft_agreement"),
        "prompts": len(rows),
        "mean_prompt_tokens": mean(rows, "prompt_tokens"),
        "new_tokens": new_tokens,
        "costs": {k: round(mean(costs, k), 4) for k in costs[0]},
    }
    if high_tasks:
        agree = []
        for task in high_tasks:
            prompt, ref = _encode_task(tokenizer, task, (target, draft), new_tokens)
            agree.append(agreement(target, draft, prompt, ref, new_tokens))
            bar.update(1)
        result["draft_agreement_high"] = sum(agree) / len(agree)
    if sort_tasks:
        acc = []
        for task in sort_tasks:
            prompt, ref = _encode_task(tokenizer, task, (target,), new_tokens)
            acc.append(copy_accuracy(greedy_reference(target, prompt, new_tokens), ref, new_tokens))
            bar.update(1)
        result["target_sort_accuracy"] = sum(acc) / len(acc)
    if code_windows:
        t, d = code_scores(target, code_windows), code_scores(draft, code_windows)
        result.update({"target_code_top1": t["top1"], "target_code_nll": t["nll"], "draft_code_top1": d["top1"],
                       "draft_code_nll": d["nll"], "code_tokens": sum(len(w) - 1 for w in code_windows)})
        bar.update(1)
    bar.close()
    result["per_prompt"] = rows
    return result


def _encode_task(tokenizer, task: Task, models, new_tokens: int) -> tuple[list[int], list[int]]:
    prompt, ref = encode(tokenizer, task.prompt), encode(tokenizer, task.reference)
    if not ref:
        raise ValueError(f"task {task.task_id!r} has no reference continuation to score against")
    for m in models:
        check_fits(m, len(prompt) + max(new_tokens, 1))
    return prompt, ref


@torch.inference_mode()
def code_scores(model, windows: list[list[int]]) -> dict:
    """Teacher-forced top-1 accuracy and NLL (nats/token) of ``model`` on token windows of plain code."""
    hits = nll = n = 0.0
    for w in windows:
        ids = torch.tensor([w], device=model.device)
        logits = model(input_ids=ids[:, :-1]).logits[0].float()
        y = ids[0, 1:]
        hits += (logits.argmax(-1) == y).sum().item()
        nll += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        n += len(y)
    return {"top1": hits / n, "nll": nll / n}


def code_windows(tokenizer, files, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` deterministic windows of ``length + 1`` tokens of plain code (a ``# file:`` header, then lines)."""
    rng = random.Random(f"code-eval/{seed}")
    files = [f for f in files if f.text.count("\n") >= 8]
    out = []
    for _ in range(100 * n):
        if len(out) == n or not files:
            break
        f = files[rng.randrange(len(files))]
        lines = f.text.splitlines(keepends=True)
        start = rng.randrange(max(1, len(lines) - 4))
        ids = encode(tokenizer, FILE_HEADER.format(name=f.name) + "".join(lines[start:]))
        if len(ids) > length:
            out.append(ids[:length + 1])
    if not out:
        raise ValueError(f"no file in the corpus has {length + 1} tokens for a plain-code window")
    return out
