"""LoRA adapters for drafts: attach, save with a fingerprint of the base model, load (merged or not).

peft checks shapes but not identity: an adapter trained on another model of the same shape loads silently and is
wrong. So an adapter folder also holds ``rift_base.json``, a fingerprint of the base weights it was trained on.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

FINGERPRINT_FILE = "rift_base.json"
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fingerprint(model) -> dict:
    cfg = model.config
    emb = model.get_input_embeddings().weight.detach().float()
    return {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "embedding_checksum": round(float(emb.sum() + (emb * emb).sum()), 3)}


def attach(model, rank: int = 8, alpha: int = 16, dropout: float = 0.0, target_modules=DEFAULT_TARGET_MODULES):
    """A trainable LoRA wrapper around ``model`` (which is left frozen)."""
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    modules = [m for m in target_modules if m in present]
    if not modules:
        raise ValueError(f"none of the LoRA target modules {list(target_modules)} exist in this model")
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, bias="none",
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def save(peft_model, base_fingerprint: dict, folder: str | Path) -> None:
    folder = Path(folder)
    peft_model.save_pretrained(folder)
    (folder / FINGERPRINT_FILE).write_text(json.dumps(base_fingerprint, indent=1))


def load_drafter(base, folder: str | Path, merge: bool = False, copy_base: bool = True):
    """``base`` with the adapter in ``folder`` applied. ``copy_base`` keeps ``base`` itself unadapted (needed for
    self-speculation, where the unadapted model verifies). ``merge`` folds the adapter into the weights."""
    from peft import PeftModel

    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} holds no LoRA adapter (adapter_config.json)")
    fp_file = folder / FINGERPRINT_FILE
    if fp_file.is_file():
        want, have = json.loads(fp_file.read_text()), fingerprint(base)
        if want != have:
            diff = {k: (want.get(k), have.get(k)) for k in want if want.get(k) != have.get(k)}
            raise ValueError(f"the adapter in {folder} was trained for another base model (trained on vs given: "
                             f"{diff})")
    model = copy.deepcopy(base) if copy_base else base
    drafter = PeftModel.from_pretrained(model, str(folder))
    drafter.eval()
    if merge:
        drafter = drafter.merge_and_unload()
    for p in drafter.parameters():
        p.requires_grad_(False)
    return drafter


@torch.no_grad()
def max_lora_delta(peft_model) -> float:
    """Largest |B @ A| entry over the adapted layers (0 for a freshly initialised adapter)."""
    best = 0.0
    for module in peft_model.modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
            best = max(best, float(delta.abs().max()))
    return best
