"""Training the testbed's target and draft from scratch on this machine's CPU (or a GPU).

Both models are ordinary HF Llama models trained from random initialisation; nothing is hand-set. The recipe is a
list of stages of growing sequence length. Each stage draws batches of six kinds:

- ``repeat``: uniform random tokens in which one segment is written again and again after random gaps. Dense repeats
  make induction heads (match, then copy) form within minutes in a small model (shared/notes/TESTBED.md).
- ``code``: plain windows of training-split source files behind ``# file: NAME`` headers: the language model.
- ``low`` / ``mixed`` / ``high`` / ``sort``: the task formats the framework evaluates, built by the task builder from
  training-split files. In ``low`` and ``sort`` samples some tokens of the continuation are corrupted in the *input*
  (the targets stay right), so the model learns to resynchronise after an error when copying greedily.

Lengths grow stage by stage (256 -> 4.6K tokens): a model trained at short lengths does not retrieve from further
back than it was trained on. Target and draft see the same batches in the same loop (the draft is smaller: the
weaker model real drafts are); each has its own AdamW, reset at every stage boundary so a stage can be resumed from
its start with the weights alone. Within a stage a checkpoint (weights, optimisers, data RNG states) is written
every few minutes; resuming from it reproduces an uninterrupted run bit for bit on the same hardware and threads.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rift_ada.data.corpus import SourceFile
from rift_ada.files import read_torch
from rift_ada.data.tasks import FILE_HEADER, TaskBuilder
from .check import code_scores

IGNORE = -100
KINDS = ("repeat", "code", "low", "mixed", "high", "sort")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    # Llama 3's base for an 8K context: the slowest rotary pairs still separate positions 8K apart, and the
    # fastest ones give the previous-token heads that induction is built from.
    rope_theta: float = 5e5
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


@dataclass(frozen=True)
class Stage:
    steps: int
    length: int
    batch: int
    lr: tuple[float, float]  # learning rate at the stage's first and last step (linear in between)
    mix: dict = field(default_factory=lambda: {"repeat": 1.0})  # kind -> probability
    warmup: int = 0  # linear warm-up steps at the stage's start
    corrupt: float = 0.03  # share of continuation tokens corrupted in half of the low / sort samples
    stop_below: float | None = None  # end the stage once every model's running loss (each kind) is below this
    train: tuple[str, ...] | None = None  # the models this stage trains (None: all); the others wait
    task_loss: str = "all"  # "continuation": task samples train on their continuation only (the copy itself)


    def lr_at(self, step: int) -> float:
        base = self.lr[0] + (self.lr[1] - self.lr[0]) * step / max(1, self.steps - 1)
        return base * min(1.0, (step + 1) / self.warmup) if self.warmup else base

    @property
    def tokens(self) -> int:
        return self.steps * self.length * self.batch


class SampleSource:
    """Training sequences of every kind, drawn from the training split with the RNGs it is handed."""

    def __init__(self, tokenizer, files: list[SourceFile]):
        self.tok = tokenizer
        self.vocab = len(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.tasks = TaskBuilder(tokenizer, files)
        self.files = [f for f in files if f.text.count("\n") >= 8]
        self._lines: dict[str, list[list[int]]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _file_lines(self, f: SourceFile) -> list[list[int]]:
        if f.name not in self._lines:
            self._lines[f.name] = self.tok(f.text.splitlines(keepends=True), add_special_tokens=False)["input_ids"]
        return self._lines[f.name]

    def repeat(self, nrng: np.random.Generator, length: int):
        """Dense repeats: one random segment copied again and again; loss on 2nd+ copies (first token excluded)."""
        seg_len = int(nrng.integers(8, 25))
        seg = nrng.integers(1, self.vocab, seg_len)
        ids = nrng.integers(1, self.vocab, length + 1)
        mask = np.zeros(length + 1, dtype=bool)
        pos, k = int(nrng.integers(0, 17)), 0
        max_gap = max(16, length // 8)
        while pos + seg_len <= length + 1:
            ids[pos:pos + seg_len] = seg
            if k > 0:
                mask[pos + 1:pos + seg_len] = True
            k += 1
            pos += seg_len + int(nrng.integers(0, max_gap + 1))
        return ids, ids, mask

    def code(self, rng: random.Random, length: int):
        out: list[int] = []
        while len(out) < length + 1:
            f = self.files[rng.randrange(len(self.files))]
            lines = self._file_lines(f)
            start = rng.randrange(max(1, len(lines) - 4))
            out += self.encode(FILE_HEADER.format(name=f.name))
            for ln in lines[start:]:
                out += ln
                if len(out) > length:
                    break
        ids = np.array(out[:length + 1])
        return ids, ids, np.ones(length + 1, dtype=bool)

    def task(self, rng: random.Random, family: str, length: int, corrupt: float, continuation_only: bool = False):
        """One task of ``family`` (prompt + continuation) filling ``length + 1`` tokens; EOS-padded, pad masked."""
        ref = rng.randint(length // 8, length // 3)
        task = self.tasks.build(family, rng.randrange(1 << 30), input_tokens=length + 1 - ref, reference_tokens=ref,
                                min_reference_tokens=min(ref, 48), seed=rng.randrange(1 << 30))
        prompt, cont = self.encode(task.prompt), self.encode(task.reference)
        seq = (prompt + cont)[:length + 1]
        n = len(seq)
        ids = np.array(seq + [self.eos] * (length + 1 - n))
        mask = np.zeros(length + 1, dtype=bool)
        mask[len(prompt) if continuation_only else 0:n] = True
        inputs = ids.copy()
        if corrupt > 0 and family in ("low", "sort") and rng.random() < 0.5:
            lo, hi = len(prompt) + 4, n - 1
            for _ in range(max(1, round(corrupt * (hi - lo))) if hi > lo else 0):
                inputs[rng.randrange(lo, hi)] = rng.randrange(1, self.vocab)
        return inputs, ids, mask

    def batch(self, kind: str, stage: Stage, rng: random.Random, nrng: np.random.Generator):
        xs, ys = [], []
        for _ in range(stage.batch):
            if kind == "repeat":
                inputs, ids, mask = self.repeat(nrng, stage.length)
            elif kind == "code":
                inputs, ids, mask = self.code(rng, stage.length)
            elif kind in ("low", "mixed", "high", "sort"):
                inputs, ids, mask = self.task(rng, kind, stage.length, stage.corrupt,
                                              continuation_only=stage.task_loss == "continuation")
            else:
                raise ValueError(f"unknown batch kind {kind!r}; choose from {', '.join(KINDS)}")
            xs.append(torch.from_numpy(np.asarray(inputs[:-1], dtype=np.int64)))
            ys.append(torch.from_numpy(np.where(mask[1:], ids[1:], IGNORE).astype(np.int64)))
        return torch.stack(xs), torch.stack(ys)


def stage_rngs(seed: int, stage: int) -> tuple[random.Random, np.random.Generator]:
    """Each stage's data comes from its own seed, so a stage resumed from its start sees the same batches."""
    return random.Random(f"testbed/{seed}/{stage}"), np.random.default_rng([seed, stage])


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.98), weight_decay=0.0, eps=1e-8)


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _autocast(device: str):
    """bf16 autocast on CUDA and on CPUs with native bf16 (1.7x faster training here); float32 elsewhere."""
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_bf16())


class Trainer:
    """Trains several models (target and draft) on the same batches, stage by stage, with checkpoints.

    ``work_dir`` holds ``checkpoint.pt`` (mid-stage: weights, optimisers, RNG states; rewritten every
    ``checkpoint_minutes``) and ``stage-K/`` folders (each model's weights at the end of stage K, enough to resume
    from stage K+1). ``log.jsonl`` gets a row every ``log_every`` steps.
    """

    def __init__(self, models: dict, stages: list[Stage], source: SampleSource, work_dir: str | Path, seed: int = 0,
                 device: str = "cpu", checkpoint_minutes: float = 5.0, log_every: int = 50,
                 eval_windows: list[list[int]] | None = None, progress: bool = True):
        self.models = models
        self.stages = stages
        self.source = source
        self.work_dir = Path(work_dir)
        self.seed = seed
        self.device = device
        self.checkpoint_seconds = checkpoint_minutes * 60
        self.log_every = log_every
        self.eval_windows = eval_windows or []
        self.progress = progress
        self.work_dir.mkdir(parents=True, exist_ok=True)

    # -- persistence -------------------------------------------------------------------------------------------
    def _stage_dir(self, k: int) -> Path:
        return self.work_dir / f"stage-{k}"

    def _save_stage(self, k: int, seconds: float) -> None:
        d = self._stage_dir(k)
        for name, m in self.models.items():
            m.save_pretrained(d / name)
        (d / "done.json").write_text(json.dumps({"stage": k, "seconds": round(seconds, 1)}))

    def _save_checkpoint(self, k: int, step: int, opts: dict, rng, nrng, running: dict, elapsed: float) -> None:
        state = {"stage": k, "step": step, "elapsed": elapsed,
                 "models": {n: m.state_dict() for n, m in self.models.items()},
                 "optimizers": {n: o.state_dict() for n, o in opts.items()}, "rng": rng.getstate(),
                 "nrng": nrng.bit_generator.state, "running": running}
        tmp = self.work_dir / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.work_dir / "checkpoint.pt")

    def resume_point(self) -> tuple[int, dict | None]:
        """(first stage still to run, mid-stage checkpoint or None); loads the weights it resumes from."""
        ckpt_path = self.work_dir / "checkpoint.pt"
        done = [k for k in range(len(self.stages)) if (self._stage_dir(k) / "done.json").is_file()]
        last_done = max(done) if done else -1
        if ckpt_path.is_file():
            ckpt = read_checkpoint(ckpt_path)
            if ckpt["stage"] > last_done:
                for n, m in self.models.items():
                    m.load_state_dict(ckpt["models"][n])
                return ckpt["stage"], ckpt
        if last_done >= 0:
            from safetensors.torch import load_file

            for n, m in self.models.items():
                state = load_file(str(self._stage_dir(last_done) / n / "model.safetensors"))
                m.load_state_dict(state, strict=False)  # tied lm_head is not stored
                m.tie_weights()
        return last_done + 1, None

    # -- training ----------------------------------------------------------------------------------------------
    def run(self, resume: bool = False, stop_after_stage: int | None = None) -> list[dict]:
        start_stage, ckpt = self.resume_point() if resume else (0, None)
        if not resume and (self.work_dir / "checkpoint.pt").exists():
            raise FileExistsError(f"{self.work_dir} already holds a build; pass --resume to continue it or choose "
                                  "another --work-dir")
        log_path = self.work_dir / "log.jsonl"
        history = [json.loads(x) for x in log_path.read_text().splitlines()] if resume and log_path.exists() else []
        history = [r for r in history if (r["stage"], r.get("step", 0)) < ((start_stage, ckpt["step"]) if ckpt else
                                                                              (start_stage, 0))]
        log_path.write_text("".join(json.dumps(r) + "\n" for r in history))
        total = sum(s.steps for s in self.stages)
        done_steps = sum(s.steps for s in self.stages[:start_stage]) + (ckpt["step"] if ckpt else 0)
        bar = tqdm(total=total, initial=done_steps, desc="testbed", disable=not self.progress, smoothing=0.05)
        for k in range(start_stage, len(self.stages)):
            if stop_after_stage is not None and k > stop_after_stage:
                break
            self._run_stage(k, ckpt if ckpt and ckpt["stage"] == k else None, bar, history, log_path)
            ckpt = None
        bar.close()
        return history

    def _run_stage(self, k: int, ckpt, bar, history, log_path) -> None:
        stage = self.stages[k]
        for m in self.models.values():
            m.train()
        models = {n: m for n, m in self.models.items() if stage.train is None or n in stage.train}
        opts = {n: _optimizer(m) for n, m in models.items()}
        rng, nrng = stage_rngs(self.seed, k)
        running = {n: {kind: [] for kind in stage.mix} for n in models}
        step0, t_before = 0, 0.0
        if ckpt is not None:
            for n, o in opts.items():
                o.load_state_dict(ckpt["optimizers"][n])
            rng.setstate(ckpt["rng"])
            nrng.bit_generator.state = ckpt["nrng"]
            running, step0 = ckpt["running"], ckpt["step"]
            t_before = ckpt.get("elapsed", 0.0)  # the stage's time in earlier sessions
        kinds, probs = zip(*stage.mix.items())
        t_stage, t_ckpt, tokens_seen = time.time(), time.time(), 0
        for step in range(step0, stage.steps):
            kind = rng.choices(kinds, probs)[0]
            x, y = self.source.batch(kind, stage, rng, nrng)
            x, y = x.to(self.device), y.to(self.device)
            for n, m in models.items():
                for g in opts[n].param_groups:
                    g["lr"] = stage.lr_at(step)
                with _autocast(self.device):
                    logits = m(input_ids=x).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(),
                                                         ignore_index=IGNORE)
                opts[n].zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opts[n].step()
                running[n][kind] = (running[n][kind] + [loss.item()])[-self.log_every:]
            tokens_seen += x.numel()
            bar.update(1)
            elapsed = time.time() - t_stage
            bar.set_postfix_str(f"stage {k + 1}/{len(self.stages)} len {stage.length} "
                                f"{tokens_seen / max(elapsed, 1e-9):,.0f} tok/s " + " ".join(
                                    f"{n[0]}:{kd}={np.mean(v):.2f}" for n in models
                                    for kd, v in running[n].items() if v))
            if (step + 1) % self.log_every == 0 or step + 1 == stage.steps:
                row = {"stage": k, "step": step + 1, "lr": stage.lr_at(step), "seconds": round(elapsed, 1),
                       **{f"{n}_loss_{kd}": round(float(np.mean(v)), 4) for n in models
                          for kd, v in running[n].items() if v}}
                history.append(row)
                with log_path.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
                if stage.stop_below is not None and all(
                        len(v) == self.log_every and np.mean(v) < stage.stop_below
                        for n in models for v in running[n].values() if v):
                    bar.update(stage.steps - step - 1)  # deterministic: the same losses end it at the same step
                    break
            if time.time() - t_ckpt > self.checkpoint_seconds and step + 1 < stage.steps:
                self._save_checkpoint(k, step + 1, opts, rng, nrng, running, t_before + time.time() - t_stage)
                t_ckpt = time.time()
        seconds = t_before + time.time() - t_stage
        row = {"stage": k, "step": step + 1, "end_of_stage": True, "seconds": round(seconds, 1)}
        for n, m in self.models.items():
            if self.eval_windows:
                m.eval()
                s = code_scores(m, self.eval_windows)
                m.train()
                row.update({f"{n}_code_top1": round(s["top1"], 4), f"{n}_code_nll": round(s["nll"], 4)})
        history.append(row)
        with log_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        bar.write(json.dumps(row))
        self._save_stage(k, seconds)
        (self.work_dir / "checkpoint.pt").unlink(missing_ok=True)


CHECKPOINT_KEYS = ("stage", "step", "models", "optimizers", "rng", "nrng", "running")


def read_checkpoint(path: Path) -> dict:
    """A mid-stage checkpoint: tensors and plain values only (the RNG states are tuples of ints and a dict), read with
    :func:`rift_ada.files.read_torch`, so a file planted in the work dir cannot run code. ValueError (one line) for a
    file that needs more, or is damaged."""
    try:
        ckpt = read_torch(path, "a testbed checkpoint")
    except ValueError as e:
        raise ValueError(f"{e}; delete it to resume from the last finished stage") from None
    if not isinstance(ckpt, dict) or set(CHECKPOINT_KEYS) - set(ckpt):
        raise ValueError(f"{path}: not a testbed checkpoint (expected a dict with {', '.join(CHECKPOINT_KEYS)})")
    return ckpt


def recipe_dict(stages: list[Stage]) -> list[dict]:
    return [{**asdict(s), "tokens": s.tokens} for s in stages]


def total_tokens(stages: list[Stage]) -> int:
    return sum(s.tokens for s in stages)


__all__ = ["KINDS", "ModelShape", "SampleSource", "Stage", "Trainer", "read_checkpoint", "recipe_dict", "total_tokens"]
