"""RIFT inside vLLM: a draft proposer whose draft keeps a compressed, refreshed KV cache per request.

vLLM builds it by dotted path (its experimental ``custom_class`` proposer)::

    from vllm import LLM
    llm = LLM(model="path/to/target",
              speculative_config={"method": "custom_class", "model": "rift_ada.vllm_proposer.RiftProposer",
                                  "num_speculative_tokens": 11},
              additional_config={"rift": {"draft": "path/to/draft", "policy": "rift-dyn", "budget": 512,
                                          "period": 32}})

or ``vllm serve path/to/target --speculative-config '{"method": "custom_class", "model":
"rift_ada.vllm_proposer.RiftProposer", "num_speculative_tokens": 11}' --additional-config '{"rift": {...}}'``.
The settings (:class:`RiftSettings`) travel in vLLM's own ``additional_config`` under the key ``"rift"``, so they
reach every worker process with the rest of vLLM's config. The draft is a model rift-ada loads itself
(``from_pretrained``: a folder, a hub id or a testbed name) beside vLLM's target; its caches live outside vLLM's
paged pool (budget x live requests, ``rift_ada.proposer.DraftPool``), which is the point: the pool keeps its
capacity for the target.

What vLLM hands the proposer each step is row i's verified context, ``token_ids_cpu[i, :num_tokens_no_spec[i]]``,
and the tokens sampled for it this step (none while its prefill is still being chunked: no draft then). There is
no request id in that call and no finish notice, so requests are told apart by their token prefix
(docs/vllm.md says why that, and not the caller's stack frames or a private hook into the runner).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, fields

from .files import atomic_write
from .policies import make_policy
from .proposer import DraftPool

__all__ = ["RiftProposer", "RiftSettings", "TESTED_VLLM", "check_vllm_version", "speculative_kwargs"]

TESTED_VLLM = "0.32.0"  # the vLLM release this plug-in is tested with (pyproject's vllm extra pins it)


@dataclass(frozen=True)
class RiftSettings:
    """The draft's settings, read from vLLM's ``additional_config["rift"]`` (a JSON object: these names)."""

    draft: str  # the draft model: a folder, a hub id or a rift-ada model name (testbed-lm-draft); "target": self
    policy: str = "rift-dyn"  # rift-stat, rift-dyn, rift-ada (with controller), full, window, snapkv
    budget: int | None = 512  # draft KV tokens per request (importance + window)
    period: int | None = 32  # rift-dyn: generated tokens between refreshes
    controller: str | None = None  # rift-ada: an exported controller file, periodic:N, entropy:X or never
    scorer: str = "snapkv"
    window_fraction: float = 0.5
    obs_window: int = 32
    lookahead: int = 64
    max_new_tokens: int = 1024  # what the ``position`` signal divides the generated length by (vLLM does not say)
    dtype: str | None = None  # the draft's dtype (default: float32 on CPU, bfloat16 on CUDA)
    stats_file: str | None = None  # if set, the pool's counters are written there as JSON after every step

    @classmethod
    def from_dict(cls, d) -> "RiftSettings":
        """Settings from a JSON object; ValueError, in one line, for a missing draft or an unknown name."""
        if not isinstance(d, dict):
            raise ValueError(f"additional_config['rift'] must be a JSON object of RIFT settings, got {d!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown RIFT setting(s) {', '.join(map(repr, unknown))}; the settings are "
                             f"{', '.join(sorted(names))}")
        if "draft" not in d:
            raise ValueError("additional_config['rift'] needs 'draft': the draft model (a folder, hub id or "
                             "rift-ada model name), or 'target' to self-speculate")
        return cls(**d)

    def make_policy(self):
        """The cache layout and refresh controller these settings name (``rift_ada.policies``)."""
        return make_policy(self.policy, None if self.policy == "full" else self.budget,
                           period=self.period if self.policy == "rift-dyn" else None,
                           controller=self.controller if self.policy == "rift-ada" else None,
                           window_fraction=self.window_fraction, scorer=self.scorer, obs_window=self.obs_window,
                           lookahead=self.lookahead)


def check_settings(settings: RiftSettings, target_vocab: int | None, max_model_len: int | None, draft_config=None):
    """The settings' policy, or ValueError in one line: a policy, budget, period or controller rift-ada refuses, a
    budget larger than the engine's context, a draft whose vocabulary is not the target's."""
    policy = settings.make_policy()
    budget = policy.layout.budget
    if max_model_len is not None and budget is not None and budget > max_model_len:
        raise ValueError(f"the draft budget ({budget} tokens) is larger than the context vLLM serves "
                         f"(max_model_len {max_model_len}): nothing would be compressed; lower 'budget'")
    if draft_config is not None and target_vocab is not None and draft_config.vocab_size != target_vocab:
        raise ValueError(f"the draft's vocabulary ({draft_config.vocab_size} tokens) differs from the target's "
                         f"({target_vocab}): draft and target must share a tokenizer")
    if not isinstance(settings.max_new_tokens, int) or settings.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {settings.max_new_tokens!r}")
    return policy


def check_vllm_version(version: str) -> bool:
    """Warn (once per process) when vLLM is not the release this plug-in was tested with: ``custom_class`` is
    experimental and its call may change between releases. True if it is."""
    if version.split("+")[0] == TESTED_VLLM:
        return True
    warnings.warn(f"rift_ada.vllm_proposer was tested with vLLM {TESTED_VLLM}, this is {version}: the custom_class "
                  "proposer interface is experimental in vLLM and may have changed", RuntimeWarning, stacklevel=2)
    return False


def speculative_kwargs(draft_length: int = 11, **settings) -> dict:
    """``LLM(...)`` keyword arguments for RIFT drafting (``speculative_config`` and ``additional_config``), the
    settings checked here, in the caller's process, before vLLM starts its workers (where an error is a worker's
    stack trace): ``LLM(model=target, **speculative_kwargs(11, draft=..., budget=512, period=32))``."""
    s = RiftSettings.from_dict(settings)
    s.make_policy()
    return {"speculative_config": {"method": "custom_class", "model": f"{__name__}.RiftProposer",
                                   "num_speculative_tokens": draft_length},
            "additional_config": {"rift": {k: v for k, v in asdict(s).items() if v is not None}}}


class RiftProposer:
    """vLLM's ``custom_class`` proposer: ``RiftProposer(vllm_config)``, ``load_model(target_model)``, then every
    step ``propose(...) -> list[list[int]]`` (k greedy drafts per row, none for a row still prefilling)."""

    def __init__(self, vllm_config):
        import vllm

        check_vllm_version(vllm.__version__)
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        self.settings = RiftSettings.from_dict(extra.get("rift"))
        spec, model_config = vllm_config.speculative_config, vllm_config.model_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = model_config.max_model_len
        self.target_vocab = model_config.get_vocab_size()
        self.target_path = model_config.model
        self.device = str(vllm_config.device_config.device)
        self.policy = check_settings(self.settings, self.target_vocab, self.max_model_len)
        self.pool: DraftPool | None = None

    def load_model(self, target_model=None) -> None:
        """Load the draft (rift-ada's own ``from_pretrained``; vLLM's target module is not used: the draft keeps
        its own caches) and check it against the target."""
        if self.pool is not None:
            return
        from .models import load_model

        name = self.target_path if self.settings.draft == "target" else self.settings.draft
        model = load_model(name, dtype=self.settings.dtype, device=self.device)
        check_settings(self.settings, self.target_vocab, self.max_model_len, model.config)
        self.pool = DraftPool(model, self.policy.layout, self.policy.controller, self.k,
                              max_new_tokens=self.settings.max_new_tokens, max_len=self.max_model_len)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **_) -> list[list[int]]:
        if self.pool is None:
            self.load_model()
        contexts = [token_ids_cpu[i, :int(num_tokens_no_spec[i])] if len(sampled) else None
                    for i, sampled in enumerate(sampled_token_ids)]
        drafts = self.pool.propose(contexts)
        if self.settings.stats_file:
            self.write_stats(self.settings.stats_file)
        return drafts

    def write_stats(self, path: str) -> None:
        """The pool's counters (``rift_ada.proposer.PoolStats``) as JSON, written whole (a reader never sees half)."""
        stats = asdict(self.pool.stats)
        stats.update(acceptance_length=self.pool.stats.acceptance_length,
                     refreshes_per_1k=self.pool.stats.refreshes_per_1k(), live=len(self.pool.sequences),
                     budget=self.policy.layout.budget, pid=os.getpid())
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(stats)))
