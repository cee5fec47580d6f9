"""Training the testbed's target and draft from scratch on this machine's CPU.

The recipe is a list of stages; each stage mixes three kinds of batches:
- ``repeat``: uniform random tokens in which one segment is written again and again after random gaps. Dense repeats
  are what makes induction heads (match, then copy) form quickly in a small model (see shared/notes/TESTBED.md).
- ``copy``: the low-entropy task format (files, ``# copy of: NAME``, the file again) from the training split, with a
  few tokens of the copied part corrupted in the *input* so the model learns to resynchronise after an error.
- ``code``: plain windows of training-split source files (the model must also write ordinary code).

Everything is built at the token level from a pre-tokenized corpus; the testbed tokenizer is line-local, so these
token sequences equal the tokenization of the same text.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data.corpus import SourceFile
from ..data.tasks import FILE_HEADER, MARKERS

IGNORE = -100


@dataclass
class ModelShape:
    layers: int = 2
    hidden: int = 128
    intermediate: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 128
    rope_theta: float = 1e20  # huge base: most rotary pairs barely turn over 8K tokens, so matching ignores distance
    max_positions: int = 8192

    def config(self, vocab_size: int, eos_id: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, max_position_embeddings=self.max_positions,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta}, tie_word_embeddings=True,
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, attention_bias=False,
        )


@dataclass
class Stage:
    steps: int
    length: int
    batch: int
    lr: float
    mix: dict = field(default_factory=lambda: {"repeat": 1.0})  # kind -> probability
    warmup: int = 0
    corrupt: float = 0.03  # share of copied tokens corrupted in copy batches


@dataclass
class CircuitInit:
    """A hand-set copying circuit to start training from (disclosed in the README and the training log).

    Induction heads did not form from data in the compute this machine has (see shared/notes/TESTBED.md), and
    greedy copying of code needs matching on a long context, since short n-grams repeat in code. So the weights
    start as such a circuit and are then trained as a whole:
    - residual layout: [constant | token code (out_dim) | x_{t-1} | x_{t-2} | ... | window averages]; the first
      ``match_dim`` dims of a token's code are its match code, which the earlier-token slots hold;
    - the first layers' heads are positional (their queries and keys read only the constant dim, and the
      rotary kernel is fitted so that the head attends to offset 1, 2, ... or evenly over a window of offsets);
    - the last layer's head 0 matches [x_t, x_{t-1}, ...] and the window averages at t against
      [x_{j-1}, x_{j-2}, ...] and the averages at j, in the rotary pairs that barely turn (distance-free), and
      copies the token code of x_j into the residual, which the tied unembedding reads out;
    - MLPs start at zero output and learn during training.
    """

    exact: int = 3  # previous-token offsets 1..exact matched exactly
    windows: tuple = ((3, 30),)  # offsets averaged into one slot each (a longer, order-free context)
    window_weight: float = 1.5  # weight of a window slot's match relative to one exact token
    match_dim: int = 24
    out_dim: int = 96
    const: float = 8.0  # the constant dim dominates the RMS, so norms barely depend on content
    sharpness: float = 12.0  # attention logit per matched slot
    copy_gain: float = 6.0
    positional_pairs: int = 14  # rotary pairs used by positional heads (the fast-turning ones)


def _fit_positional_kernel(omegas: list[float], target, t_max: int = 8192, steps: int = 600) -> torch.Tensor:
    """Query (a_f, b_f) per rotary pair so that, with a constant key (1, 0), the head's attention over distance
    D = t - j, softmax_D(sum_f a_f cos(D w_f) - b_f sin(D w_f)), matches ``target(t)`` for query positions t
    from 1 to t_max. Linear in (a, b): a small convex fit."""
    w = torch.tensor(omegas, dtype=torch.float64)
    d = torch.arange(t_max, dtype=torch.float64)
    cos, sin = torch.cos(d[:, None] * w), torch.sin(d[:, None] * w)
    ts = sorted(set(range(1, 64)) | {96, 128, 200, 300, 512, 777, 1024, 1500, 2048, 3000, 4096, 6000, t_max - 1})
    targets = [(t, target(t)) for t in ts]
    targets = [(t, p) for t, p in targets if p is not None]
    n = len(omegas)
    with torch.enable_grad():
        p = torch.zeros(2 * n, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([p], lr=0.5)
        for _ in range(steps):
            s = cos @ p[:n] - sin @ p[n:]
            loss = sum(-(tg * torch.log_softmax(s[:t + 1], 0)).sum() for t, tg in targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return p.detach().float()


def _offset_target(lo: int, hi: int):
    def target(t):
        if t < hi:
            return None
        v = torch.zeros(t + 1, dtype=torch.float64)
        v[lo:hi + 1] = 1 / (hi - lo + 1)
        return v
    return target


@torch.no_grad()
def init_copy_circuit(model, spec: CircuitInit, seed: int = 0) -> dict:
    """Overwrite ``model``'s weights (Llama, tied embeddings) with the copying circuit; returns a description."""
    cfg = model.config
    d, hd, heads, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layers = model.model.layers
    n_pos_heads = spec.exact + len(spec.windows)
    if n_pos_heads > heads * (len(layers) - 1):
        raise ValueError(f"{n_pos_heads} positional heads need {-(-n_pos_heads // heads) + 1} layers")
    md, od = spec.match_dim, spec.out_dim
    slots = [slice(1 + od + i * md, 1 + od + (i + 1) * md) for i in range(n_pos_heads)]
    if slots[-1].stop > d:
        raise ValueError(f"hidden size {d} is too small for {n_pos_heads} slots of {md} dims and a {od}-dim code")
    theta = cfg.rope_parameters["rope_theta"]
    npos = spec.positional_pairs
    omegas = [theta ** (-2 * f / hd) for f in range(hd // 2)]
    free = [f for f in range(npos + 1, hd // 2) if omegas[f] * cfg.max_position_embeddings < 0.25]
    match_dims = free + [f + hd // 2 for f in free]
    n_slots = spec.exact + len(spec.windows)
    if len(match_dims) < n_slots * md:
        raise ValueError(f"only {len(match_dims)} distance-free head dims for {n_slots} slots of {md}")

    g = torch.Generator().manual_seed(seed)
    vocab = model.model.embed_tokens.weight.shape[0]
    code = torch.randn(vocab, md, generator=g)
    rest = torch.randn(vocab, od - md, generator=g)
    code = torch.cat([code / code.norm(dim=1, keepdim=True), rest / rest.norm(dim=1, keepdim=True)], 1) / 2 ** 0.5
    for name, p in model.named_parameters():
        p.fill_(1.0) if "norm" in name else p.zero_()
    emb = model.model.embed_tokens.weight
    emb[:, 0] = spec.const
    emb[:, 1:1 + od] = code

    C = spec.const
    def scale(n_filled):  # RMSNorm's factor when the constant, the code and n_filled unit slots are in the residual
        return (d / (C * C + 1 + n_filled)) ** 0.5

    offsets = [(k, k) for k in range(1, spec.exact + 1)] + [tuple(w) for w in spec.windows]
    for h, (lo, hi) in enumerate(offsets):
        li, hh = divmod(h, heads)
        attn, s = layers[li].self_attn, scale(min(h, heads * li))
        ab = _fit_positional_kernel(omegas[:npos], _offset_target(lo, hi))
        attn.q_proj.weight[hh * hd:hh * hd + npos, 0] = ab[:npos] * hd ** 0.5 / (C * s)
        attn.q_proj.weight[hh * hd + hd // 2:hh * hd + hd // 2 + npos, 0] = ab[npos:] * hd ** 0.5 / (C * s)
        group = hh // (heads // kv)
        attn.k_proj.weight[group * hd:group * hd + npos, 0] = 1 / (C * s)
        for i in range(md):  # value: the match code (unit norm) of the attended token(s)
            attn.v_proj.weight[group * hd + i, 1 + i] = 2 ** 0.5 / s
        gain = (hi - lo + 1) ** 0.5  # an average of n distinct codes has norm ~ 1/sqrt(n)
        for i in range(md):
            attn.o_proj.weight[slots[h].start + i, hh * hd + i] = gain

    # The match head: slot k of the query at t against slot k of the key at j.
    attn, s = layers[-1].self_attn, scale(n_pos_heads)
    q_src = [slice(1, 1 + md)] + slots[:spec.exact - 1] + slots[spec.exact:]
    k_src = slots[:spec.exact] + slots[spec.exact:]
    weights = [2 ** 0.5] + [1.0] * (spec.exact - 1) + [spec.window_weight] * len(spec.windows)
    for k in range(n_slots):
        for i in range(md):
            dim = match_dims[k * md + i]
            attn.q_proj.weight[dim, q_src[k].start + i] = spec.sharpness * weights[k] * hd ** 0.5 / s
            attn.k_proj.weight[dim, k_src[k].start + i] = 1 / s
    for i in range(od):
        attn.v_proj.weight[i, 1 + i] = 1 / s
        attn.o_proj.weight[1 + i, i] = spec.copy_gain
    model.model.norm.weight.zero_()
    model.model.norm.weight[:1 + od] = 1.0
    return {"positional_heads": [{"layer": divmod(h, heads)[0], "head": divmod(h, heads)[1], "offsets": list(o)}
                                 for h, o in enumerate(offsets)],
            "match_head": {"layer": len(layers) - 1, "head": 0, "distance_free_dims": len(match_dims)},
            **{k: v for k, v in spec.__dict__.items()}}


class TokenCorpus:
    """Training files as lists of per-line token ids, plus the token ids of headers and markers."""

    def __init__(self, tokenizer, files: list[SourceFile]):
        self.tok = tokenizer
        self.files = []
        for f in tqdm(files, desc="tokenizing corpus", leave=False):
            lines = f.text.splitlines(keepends=True)
            if len(lines) < 8:
                continue
            ids = tokenizer(lines, add_special_tokens=False)["input_ids"]
            self.files.append((f.name, ids))
        self.vocab = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def window(self, rng: random.Random, budget: int) -> tuple[str, list[int], list[list[int]]]:
        """A random file's window of whole lines within ``budget`` tokens: (name, flat ids, lines)."""
        name, lines = self.files[rng.randrange(len(self.files))]
        start = rng.randrange(max(1, len(lines) - 4))
        out, used = [], 0
        for ln in lines[start:]:
            if used + len(ln) > budget:
                break
            out.append(ln)
            used += len(ln)
        return name, [t for ln in out for t in ln], out


def repeat_sample(rng: np.random.Generator, length: int, vocab: int, low: int = 1):
    """Dense repeats: one random segment copied again and again; loss on 2nd+ copies (first token excluded)."""
    seg_len = int(rng.integers(8, 25))
    seg = rng.integers(low, vocab, seg_len)
    ids = rng.integers(low, vocab, length + 1)
    mask = np.zeros(length + 1, dtype=bool)
    pos, k = int(rng.integers(0, 17)), 0
    max_gap = max(16, length // 8)
    while pos + seg_len <= length + 1:
        ids[pos:pos + seg_len] = seg
        if k > 0:
            mask[pos + 1:pos + seg_len] = True
        k += 1
        pos += seg_len + int(rng.integers(0, max_gap + 1))
    return ids, mask


def copy_sample(corpus: TokenCorpus, rng: random.Random, length: int, corrupt: float):
    """Files, then ``# copy of: NAME`` + the file again; returns (input ids, target ids, loss mask) of ``length``."""
    target_budget = rng.randint(min(length // 4, 256), max(length // 2, 64))
    name, body, _ = corpus.window(rng, target_budget)
    marker = corpus.encode(MARKERS["low"].format(name=name))
    header = corpus.encode(FILE_HEADER.format(name=name))
    ctx_budget = length + 1 - len(marker) - len(body) - len(header) - len(body)
    pieces, used = [], 0
    while ctx_budget - used > 48:
        d_name, d_ids, _ = corpus.window(rng, min(ctx_budget - used - 16, rng.randint(64, 1024)))
        h = corpus.encode(FILE_HEADER.format(name=d_name))
        if len(h) + len(d_ids) > ctx_budget - used or not d_ids:
            break
        pieces.append(h + d_ids)
        used += len(h) + len(d_ids)
    pieces.insert(rng.randint(0, len(pieces)), header + body)
    prefix = [t for p in pieces for t in p] + marker
    seq = prefix + body
    seq = seq[:length + 1]
    seq += [corpus.tok.eos_token_id] * (length + 1 - len(seq))
    ids = np.array(seq)
    mask = np.zeros(length + 1, dtype=bool)
    copy_start = len(prefix)
    mask[copy_start + 1:min(len(prefix) + len(body), length + 1)] = True
    inputs = ids.copy()
    if corrupt > 0:
        n = int(rng.random() < 0.5) * max(0, int(round(corrupt * (len(body)))))
        for _ in range(n):
            p = rng.randrange(copy_start + 4, max(copy_start + 5, min(len(seq) - 1, length)))
            inputs[p] = rng.randrange(1, corpus.vocab)
    return inputs, ids, mask


def code_sample(corpus: TokenCorpus, rng: random.Random, length: int):
    out = []
    while len(out) < length + 1:
        name, ids, _ = corpus.window(rng, rng.randint(256, 2048))
        out += corpus.encode(FILE_HEADER.format(name=name)) + ids
    ids = np.array(out[:length + 1])
    return ids.copy(), ids, np.ones(length + 1, dtype=bool)


def make_batch(kind: str, stage: Stage, corpus: TokenCorpus, rng: random.Random, nrng: np.random.Generator):
    xs, ys = [], []
    for _ in range(stage.batch):
        if kind == "repeat":
            ids, mask = repeat_sample(nrng, stage.length, corpus.vocab)
            inputs = ids
        elif kind == "copy":
            inputs, ids, mask = copy_sample(corpus, rng, stage.length, stage.corrupt)
        elif kind == "code":
            inputs, ids, mask = code_sample(corpus, rng, stage.length)
        else:
            raise ValueError(f"unknown batch kind {kind!r}")
        x = torch.from_numpy(np.asarray(inputs[:-1], dtype=np.int64))
        y = torch.from_numpy(np.where(mask[1:], ids[1:], IGNORE).astype(np.int64))
        xs.append(x)
        ys.append(y)
    return torch.stack(xs), torch.stack(ys)


def train_model(model, stages: list[Stage], corpus: TokenCorpus, seed: int = 0, desc: str = "train",
                log_every: int = 50, log=print) -> list[dict]:
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    torch.manual_seed(seed)
    model.train()
    history = []
    for si, stage in enumerate(stages):
        opt = torch.optim.AdamW(model.parameters(), lr=stage.lr, betas=(0.9, 0.98), weight_decay=0.0)
        kinds, probs = zip(*stage.mix.items())
        sched = lambda s: min(1.0, (s + 1) / max(1, stage.warmup)) * 0.5 * (1 + math.cos(math.pi * s / stage.steps))  # noqa: E731
        losses: dict[str, list[float]] = {k: [] for k in kinds}
        t0 = time.time()
        bar = tqdm(range(stage.steps), desc=f"{desc} stage {si + 1}/{len(stages)} (len {stage.length})")
        for step in bar:
            for g in opt.param_groups:
                g["lr"] = stage.lr * sched(step)
            kind = rng.choices(kinds, probs)[0]
            x, y = make_batch(kind, stage, corpus, rng, nrng)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses[kind].append(loss.item())
            if (step + 1) % log_every == 0 or step + 1 == stage.steps:
                row = {"stage": si + 1, "step": step + 1, "seconds": round(time.time() - t0, 1)}
                row.update({f"loss_{k}": round(float(np.mean(v[-log_every:])), 4) for k, v in losses.items() if v})
                history.append(row)
                bar.set_postfix({k: v for k, v in row.items() if k.startswith("loss")})
                if log:
                    log(row)
    model.eval()
    return history
