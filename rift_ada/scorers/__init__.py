"""Scorers: one per file, one contract ``score(...) -> (batch, kv_heads, tokens)`` (see ``base.py``)."""

from pathlib import Path

from .base import Scorer, pool_scores, window_attention
from .keynorm import KeyNormScorer
from .learned import LearnedScorer, is_scorer_file
from .random_scorer import RandomScorer
from .snapkv import SnapKVScorer
from .streaming import StreamingScorer
from .tova import TOVAScorer

SCORERS = {"snapkv": SnapKVScorer, "tova": TOVAScorer, "keynorm": KeyNormScorer, "streaming": StreamingScorer,
           "random": RandomScorer}


def make_scorer(name: str, **options) -> Scorer:
    """Build a scorer by name, or load a learned one from its file (``*.pt``); ``options`` go to its dataclass (e.g. snapkv's ``kernel``, ``pooling``,
    ``lookahead``). An option the scorer does not take is refused (ValueError naming it), not dropped: a setting
    that silently does nothing would make a sweep over it measure noise."""
    if isinstance(name, Scorer):
        return name
    if is_scorer_file(name):
        if options:
            raise ValueError(f"a learned scorer ({name}) takes no options, got {', '.join(map(repr, options))}")
        if not Path(name).is_file():
            raise ValueError(f"no learned scorer file {str(name)!r} (experiments/train_scorer.py writes one)")
        return LearnedScorer.load(name)
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; choose one of {', '.join(SCORERS)}")
    cls = SCORERS[name]
    known = [k for k, f in cls.__dataclass_fields__.items() if f.init and k not in ("name", "needs_queries")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"scorer {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(known) or 'none'}")
    return cls(**options)


__all__ = ["SCORERS", "KeyNormScorer", "LearnedScorer", "is_scorer_file", "RandomScorer", "Scorer", "SnapKVScorer", "StreamingScorer", "TOVAScorer",
           "make_scorer", "pool_scores", "window_attention"]
