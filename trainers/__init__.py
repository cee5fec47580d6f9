"""Trainers: controller training data and compressibility (LoRA) training of drafts."""
