"""Training a learned scorer (``rift_ada.scorers.learned``): keep the keys the continuation will read.

1. Examples. For each training prompt and the target's continuation of it (``trainers.compressibility``'s stored
   target outputs), one dense pass of the frozen draft over prompt + continuation records every layer's post-RoPE
   queries and keys (``dense_capture``). At each scoring point s (the prompt's end, as rift-stat scores, and later
   points every ``stride`` generated tokens, as a refresh does) an example per layer and KV head holds the scorer's
   features of the history before s (from the ``obs_window`` queries before s: what the cache would score with) and
   the target: the attention the next ``horizon`` queries pay to each candidate key (those before the last
   ``min_window`` keys, which a sliding window holds anyway), normalised over the candidates.
2. Fitting. The scorer's scores over the candidates, as a softmax, against the target distribution (cross-entropy),
   each example weighted by the share of the queries' attention its candidates receive (a head that reads only its
   neighbours says little about what to keep). AdamW, minibatches of examples.
3. Every ``eval_every`` steps the caller's ``evaluate(scorer_file)`` measures held-out acceptance (the script: AL of
   rift-stat at the budget, on code the models never saw) and W&B logs it beside the loss.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rift_ada.rift_layer import RiftLayer
from rift_ada.scorers.learned import (AHEAD, RECENT, SPANS, LearnedScorer, features, make_net, n_features,
                                      profiles)
from rift_ada.trainers.compressibility import dense_capture


@dataclass(frozen=True)
class ScorerConfig:
    obs_window: int = 32  # the layout's: the queries the scorer reads
    stride: int = 32  # generated tokens between scoring points after the prompt's end
    points: int = 3  # scoring points per sample (the prompt's end first)
    horizon: int = 128  # queries after a point whose attention is the target
    min_window: int = 32  # candidates end this many keys before the point
    steps: int = 600
    batch: int = 24  # examples (layer, head, point) per step
    lr: float = 3e-3
    hidden: int = 32
    seed: int = 0


def examples(draft, samples: list[dict], cfg: ScorerConfig, progress: bool = True) -> list[tuple]:
    """Per sample, point, layer and KV head: (features (tokens, F), target (tokens,), weight)."""
    out = []
    for sample in tqdm(samples, desc="scorer examples", disable=not progress):
        prompt, cont = sample["prompt_ids"], sample["continuation_ids"]
        ids = torch.cat([prompt, cont])[None].to(draft.device)
        cache = dense_capture(draft, ids)
        n, total = len(prompt), ids.shape[1]
        for s in [n + i * cfg.stride for i in range(cfg.points) if n + i * cfg.stride < total - 8]:
            for layer in cache.layers:
                if not isinstance(layer, RiftLayer):
                    continue
                out.extend(_point(layer, s, min(s + cfg.horizon, total), cfg))
    return out


@torch.no_grad()
def _point(layer, s: int, end: int, cfg: ScorerConfig) -> list[tuple]:
    keys, queries, qpos = layer.keys, layer.queries, layer.query_pos
    cand = s - cfg.min_window
    x = features(profiles(queries[:, :, s - cfg.obs_window:s].float(), keys[:, :, :s].float(),
                          qpos[s - cfg.obs_window:s], torch.arange(s)))[0, :, :cand]  # (heads, cand, F)
    # The attention the queries after s pay to the keys before s, per KV head (the mean over its group and the
    # queries, each query's softmax over every key it sees: the prompt and the continuation before it).
    attn = profiles(queries[:, :, s:end].float(), keys[:, :, :end].float(), qpos[s:end], torch.arange(end),
                    recent=1)[0, :, 0] / end  # (heads, end)
    mass = attn[:, :cand].sum(-1)
    return [(x[h].clone(), attn[h, :cand] / mass[h].clamp_min(1e-9), float(mass[h])) for h in range(x.shape[0])]


def listwise_loss(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the softmax over one example's candidates against its target distribution."""
    return -(target * torch.log_softmax(scores, -1)).sum(-1)


def train_scorer(data: list[tuple], cfg: ScorerConfig, evaluate=None, eval_every: int = 0, log=None,
                 save=None, progress: bool = True) -> tuple[LearnedScorer, list[dict]]:
    """Fit a :class:`LearnedScorer` to ``data`` (:func:`examples`). ``evaluate(scorer) -> dict`` runs before step 1,
    every ``eval_every`` steps and at the end (its numbers in the history and to ``log``); ``save(scorer)`` after
    each evaluation. Returns the scorer and the history (one entry per evaluation)."""
    if not data:
        raise ValueError("no scorer examples: the prompts are too short for the observation window and horizon")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    net = make_net(n_features(SPANS, AHEAD), cfg.hidden)
    scorer = LearnedScorer(net, SPANS, AHEAD, RECENT, {"config": cfg.__dict__, "examples": len(data)})
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=1e-4)
    history, recent = [], []

    def checkpoint(step: int):
        net.eval()
        point = {"step": step, "loss": sum(recent) / len(recent) if recent else math.nan}
        if save is not None:
            save(scorer)
        if evaluate is not None:
            point.update(evaluate(scorer))
        history.append(point)
        if log is not None:
            log(point)
        recent.clear()
        net.train()

    checkpoint(0)
    for step in tqdm(range(1, cfg.steps + 1), desc="scorer training", disable=not progress):
        batch = [data[rng.randrange(len(data))] for _ in range(cfg.batch)]
        weights = torch.tensor([w for _, _, w in batch])
        losses = torch.stack([listwise_loss(net(x).squeeze(-1), y) for x, y, _ in batch])
        loss = (losses * weights).sum() / weights.sum().clamp_min(1e-9)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        for group in opt.param_groups:  # cosine decay: the last steps settle
            group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        opt.step()
        recent.append(loss.item())
        if step == cfg.steps or (eval_every and step % eval_every == 0):
            checkpoint(step)
    net.eval()
    return scorer, history


def coverage(scorer, data: list[tuple], keep: int) -> float:
    """The mean share of the target's attention the ``keep`` best-scored candidates hold (weighted as the loss):
    what a budget of ``keep`` importance slots would keep of what the continuation reads."""
    total = weight = 0.0
    with torch.no_grad():
        for x, y, w in data:
            s = scorer.net(x).squeeze(-1) if scorer is not None else x[:, 0]  # None: SnapKV's raw profile
            total += w * float(y[s.topk(min(keep, len(s))).indices].sum())
            weight += w
    return total / max(weight, 1e-9)
