"""Trainers: counterfactual data and PPO for refresh controllers; compressibility (LoRA) training of drafts."""
