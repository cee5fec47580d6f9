"""A replay table: one prompt's continuation and, per refresh time on a grid, what the draft does over it.

A file (``.safetensors``: arrays plus a JSON header, read without unpickling anything) holds:

| array      | shape   | what                                                                                   |
|------------|---------|----------------------------------------------------------------------------------------|
| `prompt`   | (P,)    | the prompt's token ids                                                                 |
| `tokens`   | (N,)    | the continuation the target emitted (greedy, or sampled at the table's temperature)    |
| `p`        | (N,)    | the target's probability of each emitted token under the sampling settings (1 greedy)  |
| `q`        | (R, N)  | row r: the draft's q(x_u) refreshed at t_r (sampling), or 1.0 where its argmax is x_u   |
| `entropy`  | (R, N)  | row r: the draft's entropy (nats, temperature 1) predicting token u                    |
| `focus`, `runway`, `drift` | (R, N) | row r: the read-ahead and drift signals at history length P + u      |
| `full_q`, `full_entropy` | (N,) | the same for the full-cache draft (a reference; never a controller's input)        |

Row r was refreshed at history length ``t_r = P + r * grid``; its entries are defined for u > r * grid (NaN before).
Column u of a row is both the prediction of continuation token u (made by the query at absolute position P + u - 1)
and the signals a decision at history length P + u reads. ``header`` holds the provenance: format, model
fingerprints, layout, decoding settings, seed, grid, max_new_tokens, the initial signals, build time.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "rift-ada/replay-table-v1"
ARRAYS = ("prompt", "tokens", "p", "q", "entropy", "focus", "runway", "drift", "full_q", "full_entropy")
ROW_ARRAYS = ("q", "entropy", "focus", "runway", "drift")
# What a table must agree on with the decoder it stands for (and a controller's training settings with each other).
SETTINGS = ("target", "draft", "layout", "temperature", "top_k", "top_p", "grid", "max_new_tokens")


@dataclass
class ReplayTable:
    header: dict
    prompt: np.ndarray
    tokens: np.ndarray
    p: np.ndarray
    q: np.ndarray
    entropy: np.ndarray
    focus: np.ndarray
    runway: np.ndarray
    drift: np.ndarray
    full_q: np.ndarray
    full_entropy: np.ndarray
    path: str | None = field(default=None, compare=False)
    _matches: np.ndarray | None = field(default=None, compare=False, repr=False)

    # --- what the header says --------------------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    grid = property(lambda self: int(self.header["grid"]))
    temperature = property(lambda self: float(self.header["temperature"]))
    max_new_tokens = property(lambda self: int(self.header["max_new_tokens"]))
    vocab_size = property(lambda self: int(self.header["vocab_size"]))

    def row_of(self, length: int) -> int:
        """The row a refresh at history ``length`` (absolute) uses: the last grid point at or before it."""
        return (length - self.prompt_len) // self.grid

    def matches(self) -> np.ndarray:
        """(N + 1,): ``signals.suffix_match`` of the context after g generated tokens (prompt + tokens[:g]), each g;
        computed once per table (a replay reads it every round)."""
        if self._matches is None:
            from ..signals import suffix_match

            context = np.concatenate([self.prompt, self.tokens]).astype(np.int64)
            self._matches = np.asarray([suffix_match(context[:self.prompt_len + g])
                                        for g in range(len(self.tokens) + 1)])
        return self._matches

    def accept(self) -> np.ndarray:
        """(R, N) probability that a drafted token u is accepted, row by row: 0 / 1 greedy (argmax = x_u), else
        min(1, q(x_u) / p(x_u)): given the emitted text, the exact rejection rule keeps the draft at u with exactly
        this probability (docs/replay.md)."""
        if self.temperature == 0:
            return self.q
        return np.minimum(1.0, self.q / self.p[None])

    # --- files -----------------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.numpy import save_file

        from ..files import atomic_write

        arrays = {name: np.ascontiguousarray(getattr(self, name)) for name in ARRAYS}
        return atomic_write(path, lambda tmp: save_file(arrays, str(tmp), metadata={"header": json.dumps(self.header)}))

    @classmethod
    def load(cls, path: str | Path) -> "ReplayTable":
        """A table saved by :meth:`save`; ValueError (one line naming the file) for anything else."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such replay table")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                arrays = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path}: not a replay table (unreadable safetensors file: {str(e).splitlines()[0]})") \
                from None
        try:
            header = json.loads(meta.get("header", "null"))
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            held = header.get("format") if isinstance(header, dict) else None
            raise ValueError(f"{path}: not a replay table of format {FORMAT!r} (its header says {held!r})")
        missing = [a for a in ARRAYS if a not in arrays]
        if missing:
            raise ValueError(f"{path}: replay table lacks arrays {', '.join(missing)}")
        table = cls(header, **{a: arrays[a] for a in ARRAYS}, path=str(path))
        table._check_shapes(path)
        return table

    def _check_shapes(self, where) -> None:
        n, r = self.tokens.shape[0], self.q.shape[0]
        bad = [a for a in ROW_ARRAYS if getattr(self, a).shape != (r, n)]
        bad += [a for a in ("p", "full_q", "full_entropy") if getattr(self, a).shape != (n,)]
        if bad or r != -(-max(n - 1, 1) // self.grid) or self.prompt.ndim != 1:
            raise ValueError(f"{where}: replay table arrays do not fit each other ({', '.join(bad) or 'rows'})")

    # --- matching what it is used with -----------------------------------------------------------------------------
    def settings(self) -> dict:
        return {k: self.header.get(k) for k in SETTINGS}

    def check(self, **expected) -> None:
        """ValueError (one line naming the table and the first setting that differs) unless the table was built
        with ``expected`` (any of SETTINGS: target / draft fingerprints, layout dict, temperature, ...)."""
        for key, want in expected.items():
            have = self.header.get(key)
            if _canon(have) != _canon(want):
                where = self.path or "replay table"
                raise ValueError(f"{where} was built with {key} {_short(have)}, not {_short(want)}: rebuild it "
                                 "(python -m rift_ada.replay build) for these models and settings")


def layout_dict(layout) -> dict:
    """A CacheLayout as the table header stores it."""
    return {k: v for k, v in asdict(layout).items() if not k.startswith("_")}


def fingerprint(model) -> str:
    """sha256 over a model's config and weights (names, shapes, bytes): which models a table was built with."""
    import torch

    if model in _FINGERPRINTS:
        return _FINGERPRINTS[model]
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    _FINGERPRINTS[model] = value = h.hexdigest()[:16]
    return value


_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # hashing 200 MB takes a while: once


def _canon(v):
    return json.loads(json.dumps(v))


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


def derived_path(stem: Path, key: str) -> Path:
    """Where the table derived from ``<stem>.safetensors`` under another layout ``key`` lives
    (``replay.build.derive_tables``): beside it, so :func:`load_folder` must tell the two apart."""
    return stem.with_name(f"{stem.name}.{key}.safetensors")


def load_folder(folder, one_decoder: bool = True) -> list[ReplayTable]:
    """The main tables in ``folder`` (``<name>.safetensors``), in name order, without the tables derived from them
    (``<name>.<key>.safetensors``: SnapKV, window or other budgets over the same continuations, :func:`derived_path`),
    which stand for other caches and must not be replayed as if they were the same decoder's. ValueError (one line)
    if there are none, or (``one_decoder``: for a replay that stands for one decoder) if they were built with different
    settings."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder of replay tables")
    tables = [ReplayTable.load(f) for f in sorted(folder.glob("*.safetensors")) if "." not in f.stem]
    if not tables:
        raise ValueError(f"{folder}: no replay tables (<name>.safetensors; tables derived from them, "
                         "<name>.<key>.safetensors, are not read)")
    if one_decoder:
        check_same_settings(tables)
    return tables


def check_same_settings(tables) -> None:
    """ValueError (one line) unless every table was built with the same models and settings (one decoder they stand
    for: an environment's, a pricing's)."""
    first = tables[0].settings()
    for t in tables[1:]:
        t.check(**first)


def job_tables(run) -> tuple[dict, list[ReplayTable], list[ReplayTable]]:
    """A main job's output folder (``experiments/train_controller.py --output-dir``): its options
    (``state/config.json``), its training tables (``tables/train-*``) and its held-out ones (``tables/heldout-*``).
    FileNotFoundError (one line) if it has no training tables."""
    run = Path(run)
    if not (run / "state" / "config.json").is_file():
        raise FileNotFoundError(f"{run} is not a main job's output folder (no state/config.json)")
    config = json.loads((run / "state" / "config.json").read_text())
    tables = run / "tables"
    train = [ReplayTable.load(f) for f in sorted(tables.glob("train-*.safetensors"))]
    if not train:
        raise FileNotFoundError(f"no training tables in {tables}: run the main job first")
    heldout = [ReplayTable.load(f) for f in sorted(tables.glob("heldout-*.safetensors"))]
    return config.get("options", config), train, heldout
