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
    rope_theta: float = 100_000.0
    max_positions: int = 8192

    def config(self, vocab_size: int, eos_id: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads, max_position_embeddings=self.max_positions,
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
