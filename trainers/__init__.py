"""Trainers: oracle labels from replay tables, PPO and DQN for refresh controllers; compressibility (LoRA) training of drafts."""
