"""Print the README's table of supported architectures, from ``rift_ada.architectures.FAMILIES``.

    python experiments/architectures_table.py

Each row is a family that ``tests/test_architectures.py`` runs (greedy output equal to the target's own ``generate``,
self and external drafts, full / rift-stat / rift-dyn, k in {1, 4, 11}); the config class and the observing
attention are read from transformers, not typed here.
"""

from __future__ import annotations


def table() -> str:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from rift_ada.architectures import FAMILIES

    rows = ["| architecture | transformers config | KV layers | draft attention | notes |", "|---|---|---|---|---|"]
    for fam in FAMILIES:
        config = fam.config()
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        observer = "`rift_sdpa`" if model_cls._supports_sdpa else "`rift_eager`"
        rows.append(f"| {fam.name} | `{type(config).__name__}` | {fam.kv_layers} | {observer} | {fam.notes or '-'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
