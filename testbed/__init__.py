"""The built-in testbed: a BPE tokenizer, a target/draft pair trained on Python source (assets/lm-*), and the
disclosed copier composed beside them at load (composed.py, circuit.py)."""
