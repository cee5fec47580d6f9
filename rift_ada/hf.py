"""rift-ada as a transformers decoding method: ``target.generate(..., custom_generate=rift_generate)``.

    from rift_ada.hf import rift_generate

    out = target.generate(**inputs, assistant_model=draft, custom_generate=rift_generate, max_new_tokens=256,
                          rift_policy="rift-dyn", rift_budget=512, rift_period=64)

``generate`` prepares the inputs as usual (generation config, logits processors, stopping criteria, streamer) and
hands the loop to :func:`rift_generate`, which runs rift-ada's own loop (``rift_ada.evaluate.decode``, its tokens
handed to the streamer and stopping criteria after each round): the same code as ``python -m rift_ada.evaluate``, not a second
implementation. Without ``assistant_model`` the target drafts for itself on the compressed cache (self-speculation).
The repository's ``custom_generate/`` folder makes the same method loadable by path,
``custom_generate="path/to/rift-ada", trust_remote_code=True``.

The ``rift_*`` arguments (a policy as in ``rift_ada.policies``):

| argument              | default      | meaning                                                                     |
|-----------------------|--------------|-----------------------------------------------------------------------------|
| ``rift_policy``       | ``rift-dyn`` | full, window, snapkv, rift-stat, rift-dyn, rift-ada                         |
| ``rift_budget``       | 512          | the draft's active KV budget in tokens (ignored by ``full``)                |
| ``rift_period``       | 64           | rift-dyn: generated tokens between refreshes                                |
| ``rift_controller``   | -            | rift-ada: a controller file, ``periodic:N``, ``entropy:X``, ``never``, or a |
|                       |              | controller object (``rift_ada.refresh``)                                    |
| ``rift_draft_length`` | 11           | draft tokens per round (k)                                                  |
| ``rift_seed``         | drawn        | the sampler's seed; by default drawn from torch's global generator, so      |
|                       |              | ``torch.manual_seed`` before ``generate`` makes sampling reproducible       |
| ``rift_layout``       | -            | more layout knobs for ``make_policy``: ``window_fraction``, ``obs_window``, |
|                       |              | ``scorer``, ``lookahead``, ...                                              |
| ``rift_draft_step``   | ``model``    | ``static`` / ``compiled``: the draft's static-shape step (``rift_ada.static``) |
| ``rift_verify_step``  | ``model``    | ``static`` / ``compiled``: the target's verify on a static cache            |
| ``rift_rounds``       | False        | with ``return_dict_in_generate=True``: the per-round records as ``.rounds`` |
| ``rift_draft``        | -            | the draft, for targets whose ``generate`` refuses ``assistant_model``       |
|                       |              | (stateful hybrids: Qwen3.5, Nemotron-H); the same as ``assistant_model``   |
| ``rift_draft_adapter``| -            | self-speculation with a LoRA adapter folder: on in the draft passes, off in |
|                       |              | the verify, on the target's own weights (``rift_ada.lora.load_self_drafter``; |
|                       |              | loaded once per model and folder)                                          |

Honoured from ``generate``: ``max_new_tokens`` / ``max_length``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
``eos_token_id`` and every stopping criterion (checked after each token, so a run stops at the token where plain
``generate`` stops), ``streamer`` (the prompt, then one ``put`` per token, then ``end``), ``return_dict_in_generate``
(``sequences``). A batch comes left-padded with its ``attention_mask`` and decodes each row as its own sequence
(``rift_ada.batch``; rows that end early are right-padded with ``pad_token_id``, as plain ``generate`` pads them).
Refused, in one line naming the argument: padding other than on the left, a streamer with a batch, beam search,
several return sequences,
logits processors other than temperature / top-k / top-p (a repetition penalty or a minimum length would have to be
applied at each draft position to keep the output distribution the target's), scores, logits, attentions and hidden
states in the output.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.generation import GenerationMixin
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .policies import make_policy
from .evaluate import decode
from .speculative import SpeculativeDecoder

DEFAULTS = dict(policy="rift-dyn", budget=512, period=64, draft_length=11)
WARPERS = {TemperatureLogitsWarper: "temperature", TopKLogitsWarper: "top_k", TopPLogitsWarper: "top_p"}
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


# model -> (adapter folder, its self-drafter): generate is called again and again, and the adapter's layers live in
# the model itself, so each model loads one adapter once (weak keys: a model deleted takes its entry with it).
_SELF_DRAFTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _self_drafter(model, draft, folder):
    """The self-drafter ``rift_draft_adapter`` names: loaded into ``model`` on first use, the same object after."""
    from .lora import load_self_drafter

    if draft is not None:
        raise ValueError("rift_draft_adapter is for the target drafting for itself; an external draft comes with its "
                         "adapter applied (rift_ada.lora.load_drafter) as assistant_model or rift_draft")
    folder = str(Path(folder).resolve())
    held = _SELF_DRAFTERS.get(model)
    if held is None:
        held = _SELF_DRAFTERS[model] = (folder, load_self_drafter(model, folder))
    elif held[0] != folder:
        raise ValueError(f"this model already holds the adapter of {held[0]}: one self-drafter adapter per model "
                         "(load the model again for another)")
    return held[1]


@dataclass
class RiftGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate``'s usual output (``sequences``), with rift-ada's per-round records (``rift_ada.speculative
    .RoundRecord``) when ``rift_rounds=True``."""

    rounds: list | None = None


@torch.no_grad()
def rift_generate(model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None,
                  generation_config=None, synced_gpus: bool = False, streamer=None, assistant_model=None,
                  rift_policy: str = DEFAULTS["policy"], rift_budget: int | None = DEFAULTS["budget"],
                  rift_period: int | None = None, rift_controller=None,
                  rift_draft_length: int = DEFAULTS["draft_length"], rift_seed: int | None = None,
                  rift_layout: dict | None = None, rift_rounds: bool = False, rift_draft=None,
                  rift_draft_step: str = "model", rift_verify_step: str = "model", rift_draft_adapter=None,
                  **model_kwargs):
    """The decoding loop ``generate(custom_generate=rift_generate)`` calls after its input preparation (see the
    module's docstring for the ``rift_*`` arguments)."""
    dropped = _arguments_generate_kept_back()
    streamer = streamer if streamer is not None else dropped.get("streamer")
    assistant_model = assistant_model if assistant_model is not None else dropped.get("assistant_model")
    if rift_draft is not None and assistant_model is not None and rift_draft is not assistant_model:
        raise ValueError("assistant_model and rift_draft name two drafts: give one")
    draft = rift_draft if rift_draft is not None else assistant_model
    if rift_draft_adapter is not None:
        draft = _self_drafter(model, draft, rift_draft_adapter)
    cfg = generation_config if generation_config is not None else model.generation_config
    _refuse_what_a_round_cannot_honour(input_ids, cfg, model_kwargs, rift_rounds)
    sampling = _sampling(cfg, logits_processor or [])
    if rift_period is None and rift_policy == "rift-dyn":
        rift_period = DEFAULTS["period"]
    try:
        policy = make_policy(rift_policy, None if rift_policy == "full" else rift_budget, period=rift_period,
                             controller=rift_controller, **(rift_layout or {}))
    except ValueError as e:  # the policy table's messages name the command-line options: name ours
        raise ValueError(str(e).replace("--", "rift_")) from None
    if rift_seed is None:  # from the global generator: torch.manual_seed(s) before generate fixes the tokens
        rift_seed = int(torch.randint(0, 2**62, (1,)))
    # eos_token_id=None: EOS stops the run through the stopping criteria below, as in plain generate (several EOS
    # ids, stop strings and custom criteria included).
    decoder = SpeculativeDecoder(model, draft, policy.layout, rift_draft_length, seed=rift_seed,
                                 store_device=None, draft_step=rift_draft_step, verify_step=rift_verify_step,
                                 **sampling)
    prompt_len = input_ids.shape[1]
    max_new = cfg.max_length - prompt_len
    if max_new < 1:
        raise ValueError(f"max_length ({cfg.max_length}) leaves no room after the {prompt_len}-token prompt: set "
                         "max_new_tokens")
    mask = model_kwargs.get("attention_mask")
    if input_ids.shape[0] > 1 or (mask is not None and not bool(mask.all())):
        return _generate_batch(model, draft, policy, rift_draft_length, rift_seed, sampling, input_ids, mask,
                               max_new, cfg, stopping_criteria, streamer, rift_rounds,
                               steps=dict(draft_step=rift_draft_step, verify_step=rift_verify_step))
    sequence = torch.empty(1, prompt_len + max_new, dtype=torch.long, device=input_ids.device)
    sequence[:, :prompt_len] = input_ids
    length = prompt_len

    def emit(tokens) -> bool:
        """Append ``tokens`` one at a time, as plain generate would; True once a stopping criterion fires (the
        decoder itself stops at max_new)."""
        nonlocal length
        for tok in tokens:
            sequence[0, length] = tok
            length += 1
            if streamer is not None:
                streamer.put(sequence[0, length - 1:length].cpu())
            if stopping_criteria is not None and bool(stopping_criteria(sequence[:, :length], None).all()):
                return True
        return False

    decode(decoder, input_ids[0].tolist(), max_new, policy.controller, on_tokens=emit)
    if streamer is not None:
        streamer.end()
    sequences = sequence[:, :length]
    if cfg.return_dict_in_generate:
        return RiftGenerateOutput(sequences=sequences, rounds=decoder.result.rounds if rift_rounds else None)
    return sequences


def _generate_batch(model, draft, policy, draft_length, seed, sampling, input_ids, mask, max_new, cfg,
                    stopping_criteria, streamer, rift_rounds, steps: dict):
    """A left-padded batch (``rift_ada.batch.BatchDecoder``): each row's prompt is its unpadded tokens, decoded as
    its own sequence; the output keeps the input's left padding and pads rows that ended early on the right with
    ``pad_token_id`` (EOS without one), as plain ``generate`` does. A row stops at its stopping criteria."""
    from .batch import BatchDecoder, decide_rows

    if streamer is not None:
        raise ValueError("a streamer takes one sequence: rift_generate streams a batch of 1 only")
    keep = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    prompts = [row[k].tolist() for row, k in zip(input_ids, keep)]
    decoder = BatchDecoder(model, draft, policy.layout, draft_length, seed=seed, **steps, **sampling)
    decoder.reset(prompts, max_new)
    rows = decoder.rows
    seen = [0] * len(rows)  # tokens of each row the stopping criteria have been asked about
    kept = [None] * len(rows)  # where a criterion stopped a row (None: it ran to its end)

    def stop_rows() -> None:
        """Each row's new tokens one at a time, as plain generate asks (a criterion may fire mid-round): a row
        stops at the first token where one fires."""
        for i, r in enumerate(rows):
            tokens = r.result.tokens
            while stopping_criteria is not None and kept[i] is None and seen[i] < len(tokens):
                seen[i] += 1
                seq = torch.tensor([prompts[i] + tokens[:seen[i]]], device=input_ids.device)
                if bool(stopping_criteria(seq, None).all()):
                    kept[i], r.done = seen[i], True

    stop_rows()
    while not decoder.done:
        decoder.step(decide_rows(policy.controller, decoder.states))
        stop_rows()
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    pad = (pad[0] if isinstance(pad, (list, tuple)) else pad) if pad is not None else 0
    outputs = [r.result.tokens[:kept[i]] for i, r in enumerate(rows)]
    sequences = torch.full((len(rows), input_ids.shape[1] + max(map(len, outputs))), int(pad), dtype=torch.long,
                           device=input_ids.device)
    sequences[:, :input_ids.shape[1]] = input_ids
    for i, tokens in enumerate(outputs):
        sequences[i, input_ids.shape[1]:input_ids.shape[1] + len(tokens)] = torch.tensor(tokens)
    if cfg.return_dict_in_generate:
        return RiftGenerateOutput(sequences=sequences,
                                  rounds=[r.result.rounds for r in rows] if rift_rounds else None)
    return sequences


@functools.cache
def _generate_code():
    return inspect.unwrap(GenerationMixin.generate).__code__


def _arguments_generate_kept_back() -> dict:
    """``assistant_model`` and ``streamer`` as the user gave them to ``generate``.

    transformers 5.24 hands a callable ``custom_generate`` only the keyword arguments its signature adds to
    ``_sample``'s, taken from ``**kwargs`` (``GenerationMixin._extract_generation_mode_kwargs``): ``assistant_model``
    and ``streamer`` are parameters of ``generate`` itself, so they never reach the callable. They are read from the
    calling ``generate``'s frame instead; a test fails if a transformers release moves them."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _generate_code():
        frame = frame.f_back
    if frame is None:  # called directly, not from generate
        return {}
    return {k: frame.f_locals.get(k) for k in ("assistant_model", "streamer")}


def _refuse_what_a_round_cannot_honour(input_ids, cfg, model_kwargs, rift_rounds: bool) -> None:
    if getattr(cfg, "num_beams", 1) != 1:
        raise ValueError(f"num_beams={cfg.num_beams}: rift_generate is speculative decoding, not beam search")
    if getattr(cfg, "num_return_sequences", 1) != 1:
        raise ValueError(f"num_return_sequences={cfg.num_return_sequences}: rift_generate returns one sequence")
    for name in UNSUPPORTED_OUTPUTS:
        if getattr(cfg, name, False):
            raise ValueError(f"{name}=True: rift_generate returns sequences (and rift_rounds), not per-token "
                             f"{name.removeprefix('output_')}")
    if rift_rounds and not cfg.return_dict_in_generate:
        raise ValueError("rift_rounds=True needs return_dict_in_generate=True (the records come as .rounds)")
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        if tuple(mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not match input_ids of shape "
                             f"{tuple(input_ids.shape)}")
        m = mask.bool()
        if bool((m[:, 1:] < m[:, :-1]).any()) or not bool(m[:, -1].all()):
            raise ValueError("attention_mask pads a prompt other than on the left (generate infers one from "
                             "pad_token_id in the prompt if none is given): rift_generate takes left-padded batches; "
                             "pass attention_mask of ones if those tokens are text")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("a filled cache was passed: rift_generate prefills its own caches from input_ids")


def _sampling(cfg, processors) -> dict:
    """``temperature``, ``top_k``, ``top_p`` of the decoder from the prepared logits processors (the user's own list
    included). Anything else would change p at each draft position in a way the rejection rule does not see."""
    found = {}
    for proc in processors:
        name = WARPERS.get(type(proc))
        if name is None:
            raise ValueError(f"{type(proc).__name__}: rift_generate applies only temperature, top_k and top_p (a "
                             "processor that changes the target's distribution per position is not supported)")
        if name in found:
            raise ValueError(f"two {type(proc).__name__}s in logits_processor: give {name} once")
        found[name] = getattr(proc, name)
    if not cfg.do_sample:  # greedy: the warpers keep the argmax
        return dict(temperature=0.0)
    return dict(temperature=float(found.get("temperature", 1.0)), top_k=int(found.get("top_k", 0)),
                top_p=float(found.get("top_p", 1.0)))
