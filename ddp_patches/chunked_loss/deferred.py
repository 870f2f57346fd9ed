"""Deferred logits: inside an acting call lm_head returns a placeholder, and the loss is computed in chunks.

``_Call`` is one acting forward: its ``deferred_head`` stands in for lm_head and returns a ``DeferredLogits``
placeholder whose every op but reading its shape raises; its ``loss`` stands in for the model's ``loss_function``
and computes the chunked loss when handed that placeholder (NOTE [Deferred logits]).
"""

from __future__ import annotations

from typing import Callable

import torch

from .function import _Head, _vocab_size, chunked_causal_lm_loss

# NOTE [Deferred logits]
# Invariant: the chunked path runs the model's own forward unchanged and is exact, or the logits are computed.
# Rule: during an acting call, lm_head returns a placeholder (a zero-stride tensor of the logits' shape, a
# subclass whose every op except reading its shape, dtype and device raises) and the model's ``loss_function``
# is swapped, on the instance, for one that computes the chunked loss when it receives that placeholder. The
# placeholder in the output becomes None. If the forward does anything else with it (scales, softcaps, slices)
# the class is marked, one WARNING line says why, the RNG is restored and the original forward runs again (once
# per class; the known transforms are read from the config first, and never reach this). If the forward never
# hands it to the loss, the real logits are computed and returned.
# Test: tests/test_chunked_loss.py::test_a_forward_that_edits_the_logits_runs_unchunked.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.2
class _Touched(Exception):
    pass


_METADATA = {"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda", "is_meta", "is_sparse",
             "is_quantized", "names", "is_nested", "grad_fn"}
_METADATA_CALLS = {"size", "dim", "stride", "numel", "is_floating_point", "is_complex", "__len__", "element_size",
                   "get_device", "is_contiguous", "__format__"}


class DeferredLogits(torch.Tensor):
    """The placeholder lm_head returns inside an acting call (NOTE [Deferred logits])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        owner = getattr(getattr(func, "__self__", None), "__name__", None)
        name = getattr(func, "__name__", "")
        if (name == "__get__" and owner in _METADATA) or name in _METADATA_CALLS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise _Touched(owner if name == "__get__" else (name or repr(func)))


def _placeholder(hidden: torch.Tensor, vocab: int) -> DeferredLogits:
    dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
        else hidden.dtype
    base = torch.zeros((), dtype=dtype, device=hidden.device).expand(*hidden.shape[:-1], vocab)
    return torch.Tensor._make_subclass(DeferredLogits, base, False)


class _Call:
    """One acting forward: what the deferred head saw, and the loss computed from it."""

    def __init__(self, model: torch.nn.Module, head_module: torch.nn.Module, params: tuple) -> None:
        self.model, self.params = model, params
        self.head = _Head(head_module, type(head_module).forward.__get__(head_module))
        self.hidden: torch.Tensor | None = None
        self.placeholder: DeferredLogits | None = None
        self.used = False
        self.original_loss: Callable | None = None

    def deferred_head(self, hidden: torch.Tensor, *args, **kwargs):
        if args or kwargs or self.placeholder is not None:
            raise _Touched("lm_head called with more arguments, or twice")
        self.hidden = hidden
        self.placeholder = _placeholder(hidden, _vocab_size(self.head, hidden.reshape(-1, hidden.shape[-1])))
        return self.placeholder

    def loss(self, logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kwargs):
        if logits is not self.placeholder or self.placeholder is None:
            if isinstance(logits, DeferredLogits):
                raise _Touched("loss_function received another tensor derived from the logits")
            return self.original_loss(logits=logits, labels=labels, vocab_size=vocab_size,
                                      num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                      shift_labels=shift_labels, **kwargs)
        self.used = True
        return chunked_causal_lm_loss(self.head, self.hidden, labels, self.params, num_items_in_batch,
                                      ignore_index, shift_labels)

    def finish(self, output):
        """The output with the placeholder replaced: None where the loss used it, the real logits where not."""
        if self.placeholder is None:
            return output
        value = None
        if not self.used:
            value = self.head(self.hidden)
        if isinstance(output, dict):
            for key in [k for k, v in output.items() if v is self.placeholder]:
                output[key] = value
            return output
        if isinstance(output, tuple):
            return type(output)(value if v is self.placeholder else v for v in output)
        return output
