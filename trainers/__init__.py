"""Trainers: counterfactual data, PPO and DQN for refresh controllers; compressibility (LoRA) training of drafts."""
