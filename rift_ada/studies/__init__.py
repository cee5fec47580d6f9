"""Code serving single scripts of ``experiments/`` (benchmarks, studies): the core never imports it."""
