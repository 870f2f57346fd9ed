"""Offload policy: which checkpoint inputs may move, whether dropping one frees memory, and in-place edit checks.

Pure functions of a tensor; no streams, no bookkeeping (``offloader.py`` orchestrates and holds the rule
NOTE [What is never offloaded]; ``handles.py`` holds NOTE [In-place edits after pack]).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

# Reasons a packed tensor stays where it is (keys of OffloadStats.kept).
PARAMETER = "parameter"
PARAMETER_VIEW = "view of a parameter"
GRAD_LEAF = "leaf that requires grad"
EXPANDED = "expanded (stride 0)"
SMALL = "below min_bytes"
DEVICE = "device not offloaded"
POOL_CAP = "pinned pool cap"
PINNED_FAILED = "pinned allocation failed"
SHARED = "storage held elsewhere (moving it would free nothing)"
NOT_PLAIN = "not a plain strided tensor (subclass, sparse, nested, quantized, meta)"
NON_DENSE = "non-dense view (restored contiguous, reductions would change order)"


def keep_reason(t: torch.Tensor, min_bytes: int) -> str | None:
    """Why ``t`` must stay where it is, judged at pack time, or None if it may move."""
    if isinstance(t, nn.Parameter):
        return PARAMETER
    if not plain(t):
        return NOT_PLAIN
    base = t._base
    if base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)):
        return PARAMETER_VIEW
    if t.is_leaf and t.requires_grad:
        return GRAD_LEAF
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        return EXPANDED
    if t.numel() * t.element_size() < max(min_bytes, 1):
        return SMALL
    if not dense(t):
        return NON_DENSE
    return None


def plain(t: torch.Tensor) -> bool:
    """A tensor whose bytes are all of it: exactly ``torch.Tensor``, strided, not nested, quantized or meta. A
    wrapper subclass (DTensor, a ``__torch_dispatch__`` tensor) copied into a plain host buffer would come back
    as a plain tensor; sparse and nested layouts have no strides to restore."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_nested and not t.is_quantized
            and not t.is_meta)


class _Slot:
    __slots__ = ("tensor",)


def _python_refs_of_a_slot() -> int:
    """``sys.getrefcount`` of a tensor referenced by one slot only, measured (it differs between Pythons)."""
    probe = _Slot()
    probe.tensor = torch.empty(0)
    return sys.getrefcount(probe.tensor)


_SOLE_SLOT_REFS: list[int] = []
_BASE_ONLY_VIA_VIEW: list[tuple[int, int]] = []


def _base_counts(base: torch.Tensor) -> tuple[int, int]:
    return sys.getrefcount(base), base._use_count()


def _base_only_via_its_view() -> tuple[int, int]:
    """The counts of a view's base that nothing but the view holds, measured (they differ between builds)."""
    probe = torch.empty(2) * 1.0
    view = probe[:1]
    del probe
    return _base_counts(view._base)


def sole_owner(holder, attr: str = "source") -> bool:
    """True when ``getattr(holder, attr)`` is the only thing keeping its memory alive, so dropping it frees it.

    Three counts, because each misses a kind of holder: the Python reference count (a list of hidden states kept
    for ``output_hidden_states``), the TensorImpl use count (a C++ holder such as another op's SavedVariable) and
    the storage use count (a view or ``detach()`` alias of the same memory). A view whose base nothing else
    holds (an autograd Function that returns its input, as FSDP2's pre-forward hook does, makes one) frees the
    base with it: the base's own counts are compared with those of a probe base held only by its view. On a
    torch without these counters the answer is True, which is what an implementation that does not check assumes.
    """
    if not _SOLE_SLOT_REFS:
        _SOLE_SLOT_REFS.append(_python_refs_of_a_slot())
        _BASE_ONLY_VIA_VIEW.append(_base_only_via_its_view())
    if sys.getrefcount(getattr(holder, attr)) > _SOLE_SLOT_REFS[0]:
        return False
    t = getattr(holder, attr)
    try:
        if t._use_count() != 1:
            return False
        users = torch._C._storage_Use_Count(torch._C._storage_id(t))
        if t._base is None:
            return users == 1
        return users == 2 and _base_counts(t._base) == _BASE_ONLY_VIA_VIEW[0]
    except (AttributeError, RuntimeError, TypeError):
        return True


def dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly numel elements of its storage (any dim order): its strides can be kept.
    A non-dense view would come back contiguous, and a reduction over it would add in another order (not
    bit-identical), so such inputs stay on the device."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def version_witness(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter and none of its memory (NOTE [In-place edits after pack])."""
    witness = t.detach()
    witness.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return witness


def check_version(witness: torch.Tensor, saved: int, shape, dtype) -> None:
    if witness._version != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{dtype} {list(shape)}], a checkpoint input, is at version {witness._version}; expected version "
            f"{saved} instead. (Raised by ddp_patches offload: NOTE [In-place edits after pack] in "
            "ddp_patches/offload/handles.py.) Hint: avoid modifying a checkpoint's input in place after the "
            "checkpoint ran."
        )
