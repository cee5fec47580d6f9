"""Fixed-size states of linear-attention / Mamba layers (hybrid models), and how a round rolls them back.

A linear-attention layer keeps a conv state (the last ``conv_kernel`` inputs of its causal convolution) and a
recurrent state (Gated DeltaNet's or Mamba-2's ``(heads, d, d)`` matrix). Both have a fixed size, so they are exact
and never compressed; but a recurrent state cannot be cropped (transformers' ``LinearAttentionCacheLayerMixin
.is_croppable`` is False once it exists, and its assisted generation refuses such models). transformers gives conv
states a rollback (``activate_past_recording`` + ``crop``) and nothing for recurrent states, so rift-ada keeps copies:

- **draft** (:class:`StateLayer`, in ``RiftCache``): it feeds one forward per drafted token, so the decoder calls
  ``RiftCache.checkpoint()`` after each forward but the last, which copies the states into preallocated slots; a
  rollback copies back the slot taken after the last kept token. Exact (the very tensors), no recompute.
- **target** (:class:`TargetStates`, around its ``DynamicCache``): it verifies k + 1 tokens in one forward, whose
  kernels (chunked delta rule, Mamba-2 chunk scan) give only the final state. So the states are copied before the
  verify forward, and after a partial acceptance ``TargetStates.roll_back`` puts them back and feeds the 1 + n kept
  tokens again: one more target forward over <= k + 1 tokens, only on rounds with a rejection (hybrid replay).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer


def state_layers(cache) -> list:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _tensors(layer) -> list[torch.Tensor]:
    out = []
    for i in range(layer.number_of_states):
        out += [t for t in (layer.conv_states[i], layer.recurrent_states[i]) if t is not None]
    return out


class StateLayer(LinearAttentionLayer):
    """A linear-attention layer of the draft cache: transformers' own ``LinearAttentionLayer`` (the model's kernels
    update it exactly as they update the target's), with checkpoints to roll a round back.

    Past recording stays off, so single-token forwards take the model's fused in-place update; the checkpoints are
    copies, so in-place updates cannot reach them."""

    def __init__(self, number_of_states: int = 1):
        super().__init__(number_of_states=number_of_states)
        self._slots: list[list[torch.Tensor]] = []  # reused from round to round: no allocation once warm
        self._marks: list[int] = []  # the length each slot of this round was taken at

    def checkpoint(self, length: int) -> None:
        live = _tensors(self)
        i = len(self._marks)
        if i == len(self._slots):
            self._slots.append([t.clone() for t in live])
        else:
            for slot, t in zip(self._slots[i], live):
                slot.copy_(t)
        self._marks.append(length)

    def restore(self, length: int) -> None:
        """Put back the states checkpointed at ``length`` tokens (RuntimeError if this round took none there)."""
        if length not in self._marks:
            raise RuntimeError(f"cannot roll a linear-attention layer back to {length} tokens: its states were "
                               f"checkpointed at {self._marks or 'no length'} this round (RiftCache.checkpoint() "
                               "after each forward that may be rolled back)")
        for live, saved in zip(_tensors(self), self._slots[self._marks.index(length)]):
            live.copy_(saved)

    def end_round(self) -> None:
        self._marks.clear()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise RuntimeError("a recurrent state cannot be cropped: RiftCache.crop restores its checkpoint")

    def nbytes(self) -> int:
        return sum(t.nbytes for t in _tensors(self))

    def checkpoint_bytes(self) -> int:
        """Bytes of the checkpoint slots (kept from round to round once allocated)."""
        return sum(t.nbytes for slot in self._slots for t in slot)

    def load(self, src) -> None:
        """Take the states of a prefilled layer of the target's cache (self-speculation)."""
        for i in range(self.number_of_states):
            if src.is_conv_states_initialized[i]:
                k = src.conv_kernel_size[i]
                conv = src.conv_states[i][..., -k:]  # a layer recording its past holds more columns
                conv = torch.nn.functional.pad(conv, (k - conv.shape[-1], 0))
                self.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=k)
                self.conv_states[i].copy_(conv)
            if src.is_recurrent_states_initialized[i]:
                self.lazy_initialization(recurrent_states=src.recurrent_states[i], state_idx=i)
                self.recurrent_states[i].copy_(src.recurrent_states[i])
            self.has_previous_state[i] = src.has_previous_state[i]


class TargetStates:
    """The target's cache through a round: copies of its conv and recurrent states taken before the verify forward
    (:meth:`take`), and :meth:`roll_back`, which crops a KV-only cache and replays a hybrid one."""

    def __init__(self, cache):
        self.cache = cache
        self.layers = state_layers(cache)
        self.saved: list[list[torch.Tensor | None]] = []

    def __bool__(self) -> bool:
        return bool(self.layers)

    def roll_back(self, fed: int, kept: list[int], feed) -> bool:
        """Leave the cache holding the round's ``kept`` tokens of the ``fed`` it verified; True if it replayed.

        Attention layers crop the rejected tokens (even none: ``crop(0)`` trims sliding layers and recorded conv
        states back to their working size). A recurrent state cannot be cropped, and the verify forward's kernels
        give only its final value: after a rejection the cache goes back to where the round began and
        ``feed(kept)`` runs the kept tokens again (one more forward, over <= k + 1 tokens), so it then holds exactly
        what feeding them in one forward gives."""
        if len(kept) < fed and self.layers:
            self.cache.crop(-fed)  # attention layers (and recorded conv states) back to the round's start
            self.restore()
            feed(kept)
            self.cache.crop(0)
            return True
        self.cache.crop(len(kept) - fed)
        return False

    def take(self) -> None:
        self.saved = [[None if t is None else t.clone() for i in range(layer.number_of_states)
                       for t in (layer.conv_states[i], layer.recurrent_states[i])] for layer in self.layers]

    def restore(self) -> None:
        for layer, saved in zip(self.layers, self.saved):
            for i in range(layer.number_of_states):
                conv, rec = saved[2 * i], saved[2 * i + 1]
                if conv is not None:  # conv states recording their past change width: assigned, not copied
                    layer.conv_states[i] = conv
                if rec is not None:
                    layer.recurrent_states[i].copy_(rec)
