"""Scorers: one per file, one contract ``score(...) -> (batch, kv_heads, tokens)`` (see ``base.py``)."""

from .base import Scorer, pool_scores, window_attention
from .keynorm import KeyNormScorer
from .random_scorer import RandomScorer
from .snapkv import SnapKVScorer
from .streaming import StreamingScorer
from .tova import TOVAScorer

SCORERS = {"snapkv": SnapKVScorer, "tova": TOVAScorer, "keynorm": KeyNormScorer, "streaming": StreamingScorer,
           "random": RandomScorer}


def make_scorer(name: str, **options) -> Scorer:
    """Build a scorer by name; ``options`` go to its dataclass (e.g. ``window``, ``kernel``, ``pooling``)."""
    if isinstance(name, Scorer):
        return name
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; choose one of {', '.join(SCORERS)}")
    cls = SCORERS[name]
    fields = cls.__dataclass_fields__
    return cls(**{k: v for k, v in options.items() if k in fields and fields[k].init})


__all__ = ["SCORERS", "KeyNormScorer", "RandomScorer", "Scorer", "SnapKVScorer", "StreamingScorer", "TOVAScorer",
           "make_scorer", "pool_scores", "window_attention"]
