"""The built-in testbed: a BPE tokenizer and a target/draft pair trained on Python source, in HF format (assets/)."""
