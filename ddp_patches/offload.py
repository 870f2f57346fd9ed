"""Mechanism 3: the inputs of every non-reentrant checkpoint go to (pinned) host memory until backward.

# NOTE [What the outer hook sees]
# A non-reentrant checkpoint saves its positional tensor inputs (``_CheckpointFrame.save_inputs`` in torch
# 2.13, ``_NoopSaveInputs`` before) *before* it pushes its own ``_checkpoint_hook``; everything the region saves
# afterwards goes to that inner hook and is recomputed in backward. saved_tensors_hooks form a stack and only the
# top one is called. So hooks pushed around the whole checkpoint call see exactly the checkpoint inputs -- a
# decoder layer's input hidden states, which is what non-reentrant checkpointing keeps on the device between
# forward and backward -- and nothing else. ``checkpoint()`` looks up the module global
# ``_checkpoint_without_reentrant_generator`` at call time; wrapping it reaches every non-reentrant call
# (transformers' layers, the reentrant calls the checkpointing patch converts, user code) with no change to what
# the checkpoint computes. The wrapper delegates with ``yield from``, so our hooks are pushed before and popped
# after the checkpoint's own (the stack stays balanced, also when the region raises).
#
# The hooks are not pushed when another saved-tensor hook is already on top: inside an outer checkpoint (a
# nested checkpoint's inputs belong to the outer frame), under the user's own ``save_on_cpu``, or during
# backward recomputation. ``pack`` also returns its input untouched while a backward runs, so a recomputed
# tensor is never re-packed.
#
# NOTE [What is never offloaded]
# Moving a tensor frees device memory only if nothing else holds its storage. Parameters, views of parameters
# (``F.linear`` saves ``weight.t()``, which an isinstance(Parameter) check misses) and other leaves that require
# grad are held by the module or by autograd's AccumulateGrad node; an expanded tensor (a stride of 0) is a view
# of something smaller; a tensor under ``min_bytes`` is not worth a copy. The last checkpoint input of a forward
# is packed but left on the device: backward needs it first, so copying it out and back is pure cost. It is
# recognised without knowing the model: each pack offloads the *previous* checkpoint input, and the input still
# pending when the forward ends is the last one.
#
# NOTE [Copies, streams and lifetimes]
# Device-to-host copies go into pinned buffers (``pinned_pool``) on one side stream per device that first waits
# for the compute stream, so the copy reads a finished tensor and overlaps the next layer's forward. The handle
# drops its device tensor as soon as the copy is *issued*, after ``record_stream(side)``: the caching allocator
# then keeps the block from reuse until the side stream has passed the copy, so the memory goes back on the
# GPU's timeline however far the CPU runs ahead -- no ``Event.query()`` polling that a GPU-bound run would
# never satisfy in time. In backward, unpacking layer k's input starts the host-to-device copy of the input
# needed next (the previous offloaded one) on the side stream, so recomputation finds it on the device; the
# compute stream waits on that copy's event before using it. A restored tensor is kept on its handle, so a
# tensor shared by several checkpoints (a 4-D mask passed positionally, ``checkpoint(f, h, h)``) crosses the bus
# at most once each way per step. Without CUDA (CPU tests) the same code runs with synchronous copies into
# ordinary host memory (``_SyncCopier``); ``non_blocking`` is never used with pageable memory.
#
# NOTE [In-place edits after pack]
# autograd compares a saved tensor's version counter at unpack and raises "one of the variables needed for
# gradient computation has been modified by an inplace operation" -- but not when saved-tensor hooks are
# registered (torch/csrc/autograd/saved_variable.cpp: "we can't track versions through the hooks"). Offload would
# then silently hand back the old values and produce a wrong gradient. Each handle therefore keeps a *version
# witness*: ``t.detach()`` (which shares t's version counter) with its storage swapped for an empty one
# (``.data =``), so it follows every in-place edit of t or of any view of it, and holds no device memory. unpack
# compares it with the version at pack and raises autograd's own error, for inputs kept on the device too.
#
# NOTE [Step windows]
# Nothing marks "backward has begun" reliably: an unpack can happen inside a forward (``torch.autograd.grad`` for
# a gradient penalty), two forwards can precede one backward, a backward can raise midway, a forward can be
# thrown away. So there is no backward flag: a handle lives exactly as long as autograd keeps the saved input,
# the pending (last) input is copied out by the next pack if it is still alive, and a new accounting window (one
# micro-step in ``stats``) starts at the first pack after a backward has reached the window's inputs and every
# one of its handles has been freed (a checkpoint output dropped inside a forward frees handles too early to
# mark a step).
# The bookkeeping holds weak references only and is pruned at each pack, so it stays bounded whatever the user
# does.
#
# NOTE [Several devices]
# A model split over GPUs in one process (``device_map``) packs inputs from several devices. Each device has its
# own copy stream, and the pool keeps free buffers per device, because buffer reuse is ordered by the copy
# stream: a buffer released after device 0's stream read it must not be written by device 1's stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from . import engines as _engines
from . import versions
from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once
from .pinned_pool import PinnedBufferPool, default_cap_bytes

logger = logging.getLogger("ddp_patches")

TARGET = "torch.utils.checkpoint._checkpoint_without_reentrant_generator"
DEFAULT_MIN_BYTES = 1 << 20

# Reasons a packed tensor stays where it is (keys of OffloadStats.kept).
PARAMETER = "parameter"
PARAMETER_VIEW = "view of a parameter"
GRAD_LEAF = "leaf that requires grad"
EXPANDED = "expanded (stride 0)"
SMALL = "below min_bytes"
DEVICE = "device not offloaded"
POOL_CAP = "pinned pool cap"
PINNED_FAILED = "pinned allocation failed"
NO_CUDA = "this host has no CUDA device (activations already live in host memory; nothing is pinned)"


@dataclasses.dataclass
class OffloadStats:
    """What one micro-step did (NOTE [Step windows]); ``peak_pinned_bytes`` is host memory in use at most."""

    step: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    deduplicated: int = 0
    kept_last: int = 0
    kept: dict = dataclasses.field(default_factory=Counter)
    prefetched: int = 0
    waited: int = 0  # unpacks that had to start their own host-to-device copy
    restored_again: int = 0  # unpacks served by a tensor already brought back (shared inputs)
    copies_in: int = 0  # host-to-device copies issued
    peak_pinned_bytes: int = 0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kept"] = dict(self.kept)
        return d


def keep_reason(t: torch.Tensor, min_bytes: int) -> str | None:
    """Why ``t`` must stay where it is (see NOTE [What is never offloaded]), or None if it may move."""
    if isinstance(t, nn.Parameter):
        return PARAMETER
    base = t._base
    if base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)):
        return PARAMETER_VIEW
    if t.is_leaf and t.requires_grad:
        return GRAD_LEAF
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        return EXPANDED
    if t.numel() * t.element_size() < max(min_bytes, 1):
        return SMALL
    return None


def _dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly numel elements of its storage (any dim order): its strides can be kept."""
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
            "ddp_patches/offload.py.) Hint: avoid modifying a checkpoint's input in place after the checkpoint ran."
        )


class _Kept:
    """A checkpoint input left on the device, with the version it had when packed."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version

    def unpack(self) -> torch.Tensor:
        check_version(self.tensor, self.version, self.tensor.shape, self.tensor.dtype)
        return self.tensor


class _Offloaded:
    """One packed checkpoint input: on the device (``source``) until its copy out is issued, then on the host."""

    __slots__ = ("index", "origin", "witness", "version", "device", "dtype", "shape", "stride", "nbytes", "source",
                 "host", "restored", "prefetched", "counted_kept", "__weakref__")

    def __init__(self, t: torch.Tensor, index: int) -> None:
        self.index = index
        self.origin = weakref.ref(t)  # identity check for deduplication, without keeping ``t`` alive
        self.witness = version_witness(t)
        self.version = t._version
        self.device = t.device
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride() if _dense(t) else None  # None: restored contiguous
        self.nbytes = t.numel() * t.element_size()
        self.source: torch.Tensor | None = t
        self.host: torch.Tensor | None = None
        self.restored: torch.Tensor | None = None  # brought back once; served again to later unpacks
        self.prefetched: tuple | None = None  # (device tensor, event) started ahead of its unpack
        self.counted_kept = False  # unpacked while still on the device (counted in stats.kept_last)


class _SyncCopier:
    """Copies in program order on the current stream (CPU tensors, CPU tests)."""

    def to_host(self, h: _Offloaded) -> None:
        h.host.copy_(h.source)

    def to_device(self, h: _Offloaded, out: torch.Tensor):
        out.copy_(h.host)
        return None  # no event: the data is there

    def wait(self, tensor: torch.Tensor, event) -> None:
        pass


class _StreamCopier(_SyncCopier):
    """Asynchronous copies on one side stream per CUDA device (NOTE [Copies, streams and lifetimes]); tensors on
    other devices (the CPU tests, run on a GPU host) are copied in order, as by ``_SyncCopier``."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def to_host(self, h: _Offloaded) -> None:
        if h.device.type != "cuda":
            return super().to_host(h)
        stream = self.stream(h.device)
        stream.wait_stream(torch.cuda.current_stream(h.device))
        with torch.cuda.stream(stream):
            h.host.copy_(h.source, non_blocking=True)
        h.source.record_stream(stream)  # the block is not reused before the side stream passes the copy

    def to_device(self, h: _Offloaded, out: torch.Tensor):
        if h.device.type != "cuda":
            return super().to_device(h, out)
        stream = self.stream(h.device)
        stream.wait_stream(torch.cuda.current_stream(h.device))  # ``out`` may reuse memory still being read
        with torch.cuda.stream(stream):
            out.copy_(h.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        out.record_stream(stream)  # a prefetch never consumed must not free memory the copy still writes
        return event

    def wait(self, tensor: torch.Tensor, event) -> None:
        if event is not None:
            torch.cuda.current_stream(tensor.device).wait_event(event)


class CheckpointInputOffloader:
    """pack/unpack for the checkpoint inputs, with per-step accounting. One per process.

    Args:
        min_bytes: tensors smaller than this stay on the device.
        max_pinned_bytes: per-rank cap of the host buffer pool (None: ``pinned_pool.default_cap_bytes()``).
        should_offload: which devices' tensors to move (default: CUDA tensors). CPU tests pass ``lambda t: True``
            to run the real code path, copying CPU tensors into separate host storage.
        gate: whether the hooks are pushed at all at a checkpoint call (default: ``is_distributed``).
        engines: the engines (``ddp_patches.engines``) under which it acts (default: DDP and FSDP2; NOTE
            [Engines]); None: under any, which the single-process CPU test path uses.
        explicit: offload=True was asked for; reasons for being inert are then warnings, not debug lines.
        copier: how tensors cross between device and host (default: side streams on CUDA, in-order otherwise);
            tests inject one that models a copy still in flight.
        pool: the host buffer pool (default: pinned where CUDA exists, capped at ``max_pinned_bytes``).
    """

    def __init__(
        self,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        max_pinned_bytes: int | None = None,
        should_offload: Callable[[torch.Tensor], bool] | None = None,
        gate: Callable[[], bool] | None = None,
        explicit: bool = False,
        copier=None,
        pool: PinnedBufferPool | None = None,
        engines: tuple[str, ...] | None = _engines.ACTS_UNDER["offload"],
    ) -> None:
        self.min_bytes = min_bytes
        self._no_cuda = should_offload is None and not torch.cuda.is_available()  # the default needs CUDA
        self.should_offload = should_offload or (lambda t: t.device.type == "cuda")
        self.gate = gate or is_distributed
        self.explicit = explicit
        self.engines = engines
        cap = default_cap_bytes() if max_pinned_bytes is None else max_pinned_bytes
        self.pool = pool or PinnedBufferPool(cap, pin=torch.cuda.is_available())
        self._copier = copier
        self.stats = OffloadStats(step=1)
        self.last_step: OffloadStats | None = None
        self._pending: weakref.ref | None = None  # last packed handle, still on the device
        self._order: list[weakref.ref] = []  # this window's handles, in pack order (pruned of dead ones)
        self._by_key: dict[tuple, weakref.ref] = {}
        self._unpacked = False  # a backward reached this window's inputs (NOTE [Step windows])

    # -- when to push the hooks ------------------------------------------------------------------------------
    def wants_hooks(self, fn=None) -> bool:
        """Push pack/unpack around the checkpoint of ``fn``? (See NOTE [What the outer hook sees].)"""
        if not torch.is_grad_enabled() or _in_backward() or _engines.compiling():
            return False
        if not self.gate():
            self._inert("single-process", "the process is not distributed (world size 1)")
            return False
        if self._no_cuda:
            self._inert("no-cuda", NO_CUDA)
            return False
        if self.engines is not None:
            engine = _engines.of_function(fn)
            if engine not in self.engines:
                _engines.step_aside("offload", engine)
                return False
        return _hook_stack_free()

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def live_handles(self) -> list[_Offloaded]:
        """This window's handles that autograd still holds, in pack order."""
        return [h for h in (ref() for ref in self._order) if h is not None]

    # -- pack: forward ---------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if _in_backward():
            return t  # a recomputed tensor: never re-packed
        self._prune()
        if not self.should_offload(t):
            reason = DEVICE
            self._inert("device-" + t.device.type, f"the checkpoint inputs are on {t.device.type}, not an accelerator")
        else:
            reason = keep_reason(t, self.min_bytes)
        if reason is not None:
            self.stats.kept[reason] += 1
            return _Kept(t)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        seen = self._by_key.get(key)
        handle = seen() if seen is not None else None
        if handle is not None and handle.origin() is t:  # the same tensor again; a transpose has another key
            self.stats.deduplicated += 1
            return handle
        handle = _Offloaded(t, len(self._order))
        self._by_key[key] = weakref.ref(handle)
        self._order.append(weakref.ref(handle))
        previous = self._pending() if self._pending is not None else None
        self._pending = weakref.ref(handle)
        if previous is not None and previous.source is not None and previous.host is None:
            self._copy_out(previous)
        return handle

    def _copy_out(self, h: _Offloaded) -> None:
        if h.counted_kept:  # unpacked inside the forward (a gradient penalty), now offloaded after all
            h.counted_kept = False
            self.stats.kept_last -= 1
        buf = self.pool.acquire(h.nbytes, h.device)
        if buf is None:
            self._refused()
            return
        weakref.finalize(h, self.pool.release, buf, h.device)  # back to the pool when autograd drops the input
        h.host = _typed_view(buf, h)
        self.copier.to_host(h)
        h.source = None  # NOTE [Copies, streams and lifetimes]: released on the GPU's timeline, not polled
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += h.nbytes
        self.stats.peak_pinned_bytes = max(self.stats.peak_pinned_bytes, self.pool.in_use_bytes)

    def _refused(self) -> None:
        if self.pool.last_error is not None and self.pool.failed:
            self.stats.kept[PINNED_FAILED] += 1
            log_rank0_once("offload-alloc-failed", logging.WARNING,
                           "ddp_patches: a pinned host allocation failed (%s); those checkpoint inputs stay on "
                           "the device (lower apply(offload_max_pinned_bytes=...) to stay below what the host "
                           "can pin)", self.pool.last_error)
            self.pool.last_error = None
            return
        self.stats.kept[POOL_CAP] += 1
        log_rank0_once("offload-cap", logging.WARNING,
                       "ddp_patches: offload pinned pool reached its cap of %d MiB; further checkpoint "
                       "inputs stay on the device (raise apply(offload_max_pinned_bytes=...))",
                       self.pool.cap_bytes >> 20)

    # -- unpack: backward ------------------------------------------------------------------------------------
    def unpack(self, packed):
        self._unpacked = True
        if isinstance(packed, _Kept):
            return packed.unpack()
        if not isinstance(packed, _Offloaded):
            return packed  # a tensor returned untouched by pack (during backward)
        check_version(packed.witness, packed.version, packed.shape, packed.dtype)
        if packed.source is not None:  # not copied out (yet): the last input of its forward
            if not packed.counted_kept:
                packed.counted_kept = True
                self.stats.kept_last += 1
            self._prefetch_before(packed.index)
            return packed.source
        if packed.restored is not None:
            self.stats.restored_again += 1
            return packed.restored
        if packed.prefetched is not None:
            tensor, event = packed.prefetched
            packed.prefetched = None
            self.stats.prefetched += 1
        else:
            tensor, event = self._copy_in(packed)
            self.stats.waited += 1
        self.copier.wait(tensor, event)
        packed.restored = tensor
        self._prefetch_before(packed.index)  # queued behind this layer's recompute and backward
        return tensor

    def _copy_in(self, h: _Offloaded) -> tuple:
        if h.stride is not None:
            out = torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=h.device)
        else:
            out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        self.stats.copies_in += 1
        return out, self.copier.to_device(h, out)

    def _prefetch_before(self, index: int) -> None:
        """Start bringing back the input that backward will ask for next: the closest earlier offloaded one."""
        for ref in reversed(self._order[:index]):
            h = ref()
            if h is None or h.source is not None or h.host is None:
                continue
            if h.prefetched is None and h.restored is None:
                h.prefetched = self._copy_in(h)
            return

    # -- step windows (NOTE [Step windows]) --------------------------------------------------------------------
    def _prune(self) -> None:
        """Drop dead handles; once a backward has run and none of this window's handles is alive, the next pack
        starts a new window."""
        if not self._order:
            return
        live = [ref for ref in self._order if ref() is not None]
        if not live and self._unpacked:
            self._end_window()
        elif len(live) < len(self._order) // 2:  # keep the list short without renumbering on every pack
            self._renumber(live)

    def _renumber(self, live: list[weakref.ref]) -> None:
        self._order = live
        for i, ref in enumerate(live):
            h = ref()
            if h is not None:
                h.index = i
        self._by_key = {k: r for k, r in self._by_key.items() if r() is not None}

    def _end_window(self) -> None:
        self.last_step = self.stats
        if self.stats.step == 1 and self.stats.offloaded_tensors:
            log_rank0_once("offload-first-step", logging.INFO,
                           "ddp_patches: offload moved %d checkpoint inputs (%.1f MiB) to host memory in the "
                           "first step; kept on the device: last layer %d, other %s",
                           self.stats.offloaded_tensors, self.stats.offloaded_bytes / 2**20,
                           self.stats.kept_last, dict(self.stats.kept))
        logger.debug("ddp_patches offload step: %s", self.stats.as_dict())
        self.stats = OffloadStats(step=self.stats.step + 1)
        self._order.clear()
        self._by_key.clear()
        self._pending = None
        self._unpacked = False

    def _inert(self, key: str, why: str) -> None:
        log_rank0_once("offload-inert-" + key, logging.WARNING if self.explicit else logging.DEBUG,
                       "ddp_patches: offload is inert here because %s; checkpoint inputs stay where they are", why)

    @property
    def copier(self):
        if self._copier is None:
            self._copier = _StreamCopier() if (torch.cuda.is_available() and self.pool.pin) else _SyncCopier()
        return self._copier


def _typed_view(buf: torch.Tensor, h: _Offloaded) -> torch.Tensor:
    typed = buf[:h.nbytes].view(h.dtype)
    if h.stride is None:
        return typed.view(h.shape)
    return typed.as_strided(h.shape, h.stride)


def _hook_stack_free() -> bool:
    """Saved-tensor hooks are enabled and none is pushed (private torch API, torch >= 2.8; without it, stay out)."""
    hooks = torch._C._autograd
    top = getattr(hooks, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(hooks, "_saved_tensors_hooks_is_enabled", None)
    if top is None or enabled is None:
        log_rank0_once("offload-no-hook-api", logging.WARNING,
                       "ddp_patches: offload needs torch >= %d.%d (torch %s cannot report pushed saved-tensor "
                       "hooks); offload stays inert", *versions.OFFLOAD_MINIMUM_TORCH, torch.__version__)
        return False
    return enabled() and top(False) is None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# -- installation ----------------------------------------------------------------------------------------------
_active: dict[str, CheckpointInputOffloader | None] = {"offloader": None}


def current() -> CheckpointInputOffloader | None:
    return _active["offloader"]


@contextlib.contextmanager
def use_offloader(offloader: CheckpointInputOffloader) -> Iterator[CheckpointInputOffloader]:
    """Run with another offloader (tests, benchmarks); the patch must be installed (apply()) for it to act."""
    previous = _active["offloader"]
    _active["offloader"] = offloader
    try:
        yield offloader
    finally:
        _active["offloader"] = previous


def _make_offloading_generator(original):
    def _checkpoint_without_reentrant_generator(fn, *args, **kwargs):
        offloader = _active["offloader"]
        if offloader is None or not offloader.wants_hooks(fn):
            return (yield from original(fn, *args, **kwargs))
        with offloader.hooks():
            return (yield from original(fn, *args, **kwargs))

    _checkpoint_without_reentrant_generator.__doc__ = original.__doc__
    return _checkpoint_without_reentrant_generator


class _Uninstall:
    """A registry handle: revert() forgets the offloader (and its pinned buffers) with the patch."""

    def remove(self) -> None:
        _active["offloader"] = None


def install(*, explicit: bool, min_bytes: int, max_pinned_bytes: int | None) -> list[str]:
    offloader = CheckpointInputOffloader(min_bytes=min_bytes, max_pinned_bytes=max_pinned_bytes, explicit=explicit)
    if explicit and offloader._no_cuda:
        offloader._inert("no-cuda", NO_CUDA)  # say it at apply(), not only at the first checkpoint
    REGISTRY.install(torch_checkpoint, "_checkpoint_without_reentrant_generator", _make_offloading_generator)
    _active["offloader"] = offloader
    REGISTRY.add_handle(_Uninstall())
    return [TARGET]


def stats() -> OffloadStats | None:
    """The last completed micro-step's offload accounting (None before the first one or when not applied)."""
    offloader = _active["offloader"]
    return None if offloader is None else offloader.last_step
