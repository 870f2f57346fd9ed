"""What ``pack`` returns for each checkpoint input: a handle kept on the device, or one offloaded to the host.

``_Kept`` holds a tensor left on the device; ``_Offloaded`` one whose copy to a host buffer started at pack, with
what ``restore`` needs to bring it back. Both let unpack raise where the tensor was edited in place since pack
(NOTE [In-place edits after pack]).
"""

from __future__ import annotations

import weakref

import torch

from .copier import PrefetchedInput
from .policy import check_version, version_witness


# NOTE [In-place edits after pack]
# Invariant: an in-place edit of a checkpoint input after pack raises autograd's own error at unpack, as without
# offload. autograd skips its version check when saved-tensor hooks are registered
# (torch/csrc/autograd/saved_variable.cpp: "we can't track versions through the hooks"), so offload would
# otherwise hand back the old values: a silently wrong gradient.
# Rule: each handle keeps a *version witness* (``policy.version_witness``: ``t.detach()``, which shares t's version
# counter, with its storage swapped for an empty one), so it follows every in-place edit of t or of any view of it
# and holds no device memory; unpack compares it with the version at pack and raises autograd's error, for inputs
# kept on the device too.
# Test: tests/test_offload_lifecycle.py::test_inplace_edit_after_pack_raises_autograds_error
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
class _Kept:
    """A checkpoint input left on the device, with the version it had when packed."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version

    def unpack(self) -> torch.Tensor:
        check_version(self.tensor, self.version, self.tensor.shape, self.tensor.dtype)
        return self.tensor


class _Offloaded:
    """One packed checkpoint input: its copy to ``host`` started at pack; ``source`` (the device tensor) is held
    while that copy may be in flight and dropped once released."""

    __slots__ = ("index", "region", "shared", "origin", "witness", "version", "device", "dtype", "shape", "stride",
                 "nbytes", "source", "event", "host", "free_host", "restored", "prefetched", "counted_kept",
                 "unpacked", "__weakref__")

    def __init__(self, t: torch.Tensor, region: int = 0) -> None:
        self.index = 0
        self.region = region  # the checkpoint region (of its window) that packed it
        self.shared = False  # packed again by a later region (a mask passed to every layer): NOTE [Any unpack order]
        self.origin = weakref.ref(t)  # identity check for deduplication, without keeping ``t`` alive
        self.witness = version_witness(t)
        self.version = t._version
        self.device = t.device
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride()  # dense (keep_reason): restored with the same strides
        self.nbytes = t.numel() * t.element_size()
        self.source: torch.Tensor | None = t
        self.event = None  # the copy out's completion (None: synchronous)
        self.host: torch.Tensor | None = None
        self.free_host = None  # gives the host buffer back to the pool (also run when the handle dies)
        self.restored: torch.Tensor | None = None  # brought back once; served again to later unpacks
        self.prefetched: PrefetchedInput | None = None  # a copy in started ahead of its unpack
        self.counted_kept = False  # unpacked while still on the device (counted in stats.kept_last)
        self.unpacked = False  # unpacked at least once (only a first unpack starts a prefetch)

    @property
    def offloaded(self) -> bool:
        """Only on the host now: a copy in is needed before backward can use it."""
        return self.source is None and self.host is not None and self.origin() is None


def _typed_view(buf: torch.Tensor, h: _Offloaded) -> torch.Tensor:
    return buf[:h.nbytes].view(h.dtype).as_strided(h.shape, h.stride)
