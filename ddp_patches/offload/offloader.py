"""Offload of checkpoint inputs: the inputs of every non-reentrant checkpoint go to (pinned) host memory until
backward (``apply(offload=True)``).

``install()`` wraps the generator ``checkpoint()`` calls (NOTE [What the outer hook sees]); a
``CheckpointInputOffloader`` supplies the pack/unpack saved-tensor hooks pushed around each call; ``stats()`` is the
last micro-step's accounting; ``use_offloader()`` runs with another offloader (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from typing import Callable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint

from .. import engines as _engines
from .. import probes, versions
from .._registry import REGISTRY
from ..distributed import is_distributed, log_rank0_once
from . import probes as offload_probes
from .copier import StreamCopier, SyncCopier
from .handles import _Kept, _Offloaded, _typed_view
from .restore import Restorer
from .policy import (  # noqa: F401  (re-exported: the reasons are part of the stats' vocabulary)
    DEVICE, EXPANDED, GRAD_LEAF, NON_DENSE, NOT_PLAIN, PARAMETER, PARAMETER_VIEW, PINNED_FAILED, POOL_CAP, SHARED,
    SMALL, check_version, keep_reason, sole_owner, version_witness)
from .window import OffloadStats, ResourceMeter, StepWindow
from .pinned_pool import DEFAULT_PREPIN_AHEAD, PinnedBufferPool, default_cap_bytes

logger = logging.getLogger("ddp_patches")

TARGET = "torch.utils.checkpoint._checkpoint_without_reentrant_generator"  # torch <= 2.13; target() is the probed one
DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_MAX_IN_FLIGHT = 1
DEFAULT_PREFETCH_DEPTH = 1
NO_CUDA = "this host has no CUDA device (activations already live in host memory; nothing is pinned)"
WHY_OPT_IN = ("offload is opt-in: its CUDA path has run on few GPUs, not yet on the range of GPUs and drivers "
              "users have (docs/benchmarks.md, 'GPU proof'; docs/options.md, 'offload')")

# Old private names, kept for code that subclassed them.
_SyncCopier, _StreamCopier = SyncCopier, StreamCopier


class CheckpointInputOffloader:
    """pack/unpack for the checkpoint inputs, with per-step accounting. One per process.

    Its parts: when the hooks are pushed (``wants_hooks``, ``hooks``), pack (policy in ``policy``, the
    copy out in ``copier``, buffers from ``pinned_pool``), release at the end of the in-flight window
    (``_release``), unpack and prefetch (``restore.Restorer``) and the step windows with their accounting
    (``window``); this class wires them to autograd's saved-tensor hooks.

    Args:
        min_bytes: tensors smaller than this stay on the device.
        max_pinned_bytes: per-rank cap of the host buffer pool (None: ``pinned_pool.default_cap_bytes()``).
        max_in_flight: checkpoint regions whose inputs keep their device tensors while the copy out may still
            run (NOTE [Copies, streams and lifetimes]); at least 1.
        prefetch_depth: inputs whose copy in starts ahead of backward's need for them, and the most prefetched
            tensors that wait at once (NOTE [Any unpack order]); at least 1.
        should_offload: which devices' tensors to move (default: CUDA tensors). CPU tests pass ``lambda t: True``
            to run the real code path, copying CPU tensors into separate host storage.
        gate: whether the hooks are pushed at all at a checkpoint call (default: ``is_distributed``).
        engines: the engines (``ddp_patches.engines``) under which it acts (default: DDP and FSDP2;
            NOTE [Engines]); None: under any, which the single-process CPU test path uses.
        explicit: offload=True was asked for; reasons for being inert are then warnings, not debug lines.
        copier: how tensors cross between device and host (default: side streams on CUDA, in-order otherwise);
            tests inject one that models a copy still in flight or a missing stream dependency.
        pool: the host buffer pool (default: pinned where CUDA exists, capped at ``max_pinned_bytes``, pinning
            ``prepin_ahead`` buffers ahead of the forward: NOTE [Pinning ahead] in pinned_pool.py).
        prepin_ahead: for the default pool only; None: ``pinned_pool.DEFAULT_PREPIN_AHEAD`` where buffers are
            pinned (a CUDA host), 0 elsewhere; 0 turns pinning ahead off.
        measure_stalls: the default CUDA copier times GPU-side waits for copies in (``stats.stall_ms``).
    """

    def __init__(
        self,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        max_pinned_bytes: int | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
        should_offload: Callable[[torch.Tensor], bool] | None = None,
        gate: Callable[[], bool] | None = None,
        explicit: bool = False,
        copier=None,
        pool: PinnedBufferPool | None = None,
        prepin_ahead: int | None = None,
        engines: tuple[str, ...] | None = _engines.ACTS_UNDER["offload"],
        measure_stalls: bool = False,
    ) -> None:
        if max_in_flight < 1 or prefetch_depth < 1:
            raise ValueError(f"CheckpointInputOffloader: max_in_flight and prefetch_depth must be >= 1, got "
                             f"{max_in_flight} and {prefetch_depth}")
        self.min_bytes = min_bytes
        self.max_in_flight = max_in_flight
        self._no_cuda = should_offload is None and not torch.cuda.is_available()  # the default needs CUDA
        self.should_offload = should_offload or (lambda t: t.device.type == "cuda")
        self.gate = gate or is_distributed
        self.explicit = explicit
        self.engines = engines
        self.pool = pool or _default_pool(max_pinned_bytes, prepin_ahead)
        self._copier = copier
        self._measure_stalls = measure_stalls
        self.restorer = Restorer(lambda: self.copier, prefetch_depth)
        self._unpack_lock = threading.RLock()
        self.window = StepWindow(step=1)
        self.last_step: OffloadStats | None = None
        self._meter = ResourceMeter()

    @property
    def stats(self) -> OffloadStats:
        """The current micro-step's accounting (NOTE [Step windows])."""
        return self.window.stats

    @property
    def prefetch_depth(self) -> int:
        return self.restorer.depth

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
        if outer_save_on_cpu():  # NOTE [One offload at a time]
            say_outer_offload_acts()
            return False
        return _hook_stack_free()

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        self._enter_region()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def _enter_region(self) -> None:
        """A new checkpoint region begins: the copies started by the regions ``max_in_flight`` back have had at
        least that many layers of compute to finish; release them (NOTE [Copies, streams and lifetimes])."""
        self._maybe_new_window()
        self.window.region += 1
        in_flight = self.window.in_flight
        in_flight.append([])
        while len(in_flight) > self.max_in_flight:
            for ref in in_flight.popleft():
                self._release(ref())

    def live_handles(self) -> list[_Offloaded]:
        """This window's handles that autograd still holds, in pack order."""
        return self.window.live()

    # -- pack: forward ---------------------------------------------------------------------------------------
    # NOTE [What is never offloaded]
    # Invariant: a tensor counts as offloaded only when moving it freed device memory: nothing else holds its
    # storage.
    # Rule: judged at pack (``policy.keep_reason``): parameters, views of parameters (``F.linear`` saves
    # ``weight.t()``, which an isinstance(Parameter) check misses) and other leaves that require grad (held by the
    # module or by AccumulateGrad), expanded tensors (a stride of 0), tensors under ``min_bytes`` and anything not a
    # plain dense strided tensor stay. Judged again when the device tensor would be dropped (``policy.sole_owner``:
    # Python, TensorImpl and storage use counts): one that something else still holds (a view or ``detach()`` alias
    # of live memory, a hidden-states list kept for ``output_hidden_states``) stays, its host copy is given back,
    # and it counts under ``kept``. The last checkpoint input of a forward is still in the in-flight window when
    # backward first asks for it: served from the device, with no copy in.
    # Tests: tests/test_offload.py::test_keep_reason_rules and
    # tests/test_offload_lifecycle.py::test_a_view_of_a_live_tensor_is_moved_but_never_counted_as_freed
    # Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
    def pack(self, t: torch.Tensor):
        if _in_backward():
            return t  # a recomputed tensor: never re-packed
        self._maybe_new_window()
        reason = self._keep_reason(t)
        if reason is not None:
            self.stats.kept[reason] += 1
            return _Kept(t)
        key = _identity(t)
        seen = self._same_tensor(t, key)
        if seen is not None:
            return seen
        buf = self.pool.acquire(t.numel() * t.element_size(), t.device)
        if buf is None:
            self.stats.kept[self._refused()] += 1
            return _Kept(t)
        return self._start_copy_out(t, key, buf)

    def _keep_reason(self, t: torch.Tensor) -> str | None:
        if not self.should_offload(t):
            self._inert("device-" + t.device.type, f"the checkpoint inputs are on {t.device.type}, not an accelerator")
            return DEVICE
        return keep_reason(t, self.min_bytes)

    def _same_tensor(self, t: torch.Tensor, key: tuple) -> _Offloaded | None:
        """The handle of ``t`` when this window packed the very same tensor already (a transpose has another
        key); one packed again by a later region is shared between layers (NOTE [Any unpack order])."""
        seen = self.window.find(key)
        if seen is None or seen.origin() is not t:
            return None
        self.stats.deduplicated += 1
        if seen.region != self.window.region:
            seen.shared = True
        return seen

    def _start_copy_out(self, t: torch.Tensor, key: tuple, buf: torch.Tensor) -> _Offloaded:
        handle = _Offloaded(t, self.window.region)
        self.window.add(handle, key)
        handle.free_host = weakref.finalize(handle, self.pool.release, buf, t.device)
        handle.host = _typed_view(buf, handle)
        handle.event = self.copier.to_host(t, handle.host)
        self.stats.peak_pinned_bytes = max(self.stats.peak_pinned_bytes, self.pool.in_use_bytes)
        if not self.window.in_flight:  # pack called outside ``hooks()`` (tests): one region of its own
            self.window.in_flight.append([])
        self.window.in_flight[-1].append(weakref.ref(handle))
        return handle

    # -- release: the end of the in-flight window ------------------------------------------------------------
    def _release(self, h: _Offloaded | None) -> None:
        """The copy out of ``h`` is old enough: the compute stream waits for it and the handle drops its device
        tensor. If something else still holds that memory, dropping it freed nothing: counted under ``kept``,
        and unpack serves the still-live tensor (``origin``) instead of copying the host copy back."""
        if h is None or h.source is None or h.host is None:
            return
        freed = sole_owner(h, "source")
        self.copier.release(h.source, h.event)
        h.source = h.event = None
        self._count_release(h, freed)

    def _count_release(self, h: _Offloaded, freed: bool) -> None:
        if h.counted_kept:  # unpacked inside the forward (a gradient penalty), offloaded after all
            h.counted_kept = False
            self.stats.kept_last -= 1
        if not freed:
            self.stats.kept[SHARED] += 1
            return
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += h.nbytes

    def _refused(self) -> str:
        if self.pool.last_error is not None and self.pool.failed:
            log_rank0_once("offload-alloc-failed", logging.WARNING,
                           "ddp_patches: a pinned host allocation failed (%s); those checkpoint inputs stay on "
                           "the device (lower apply(offload_max_pinned_bytes=...) to stay below what the host "
                           "can pin)", self.pool.last_error)
            self.pool.last_error = None
            return PINNED_FAILED
        log_rank0_once("offload-cap", logging.WARNING,
                       "ddp_patches: offload pinned pool reached its cap of %d MiB; further checkpoint "
                       "inputs stay on the device (raise apply(offload_max_pinned_bytes=...))",
                       self.pool.cap_bytes >> 20)
        return POOL_CAP

    # -- unpack: backward (restore.py) -------------------------------------------------------------------
    # NOTE [Several devices]
    # A model split over GPUs in one process (``device_map``) packs inputs from several devices. Each device has its
    # own copy stream, and the pool keeps free buffers per device, because buffer reuse is ordered by the copy
    # stream: a buffer released after device 0's stream read it must not be written by device 1's stream. In backward
    # autograd runs each device's nodes on a thread of its own, so unpacks of two devices can run at once: unpack
    # holds a lock around the restorer's bookkeeping (uncontended on one device).
    # Test: tests/test_offload_lifecycle.py::test_copies_and_buffers_are_kept_per_device
    # Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
    def unpack(self, packed):
        self.window.unpacked = True
        if isinstance(packed, _Kept):
            return packed.unpack()
        if not isinstance(packed, _Offloaded):
            return packed  # a tensor returned untouched by pack (during backward)
        # A model split over GPUs (``device_map``) is unpacked on autograd's per-device threads at once; the
        # restorer's guesses and the window's counts are shared between them (NOTE [Several devices]).
        with self._unpack_lock:
            return self.restorer.unpack(packed, self.window)

    # -- step windows (NOTE [Step windows]) --------------------------------------------------------------------
    def _maybe_new_window(self) -> None:
        if self.window.finished():
            self._end_window()
        else:
            self.window.compact()

    def _end_window(self) -> None:
        stats = self.window.stats
        self._meter.charge(stats, self.pool, self.copier)
        self.last_step = stats
        if stats.step == 1 and stats.offloaded_tensors:
            log_rank0_once("offload-first-step", logging.INFO,
                           "ddp_patches: offload moved %d checkpoint inputs (%.1f MiB) to host memory in the "
                           "first step; kept on the device: last layer %d, other %s; %d pinned buffers took "
                           "%.1f ms inside the forward, %d were pinned ahead", stats.offloaded_tensors,
                           stats.offloaded_bytes / 2**20, stats.kept_last, dict(stats.kept),
                           stats.pinned_allocations, stats.pin_ms, stats.prepinned)
        logger.debug("ddp_patches offload step: %s", stats.as_dict())
        self.window = StepWindow(step=stats.step + 1)

    def _inert(self, key: str, why: str) -> None:
        log_rank0_once("offload-inert-" + key, logging.WARNING if self.explicit else logging.DEBUG,
                       "ddp_patches: offload is inert here because %s; checkpoint inputs stay where they are", why)

    @property
    def copier(self):
        if self._copier is None:
            use_streams = torch.cuda.is_available() and self.pool.pin
            self._copier = StreamCopier(self._measure_stalls) if use_streams else SyncCopier()
        return self._copier


def _default_pool(max_pinned_bytes: int | None, prepin_ahead: int | None) -> PinnedBufferPool:
    """Pinned where CUDA exists, pinning ahead there only: a CPU-only host never pins (NOTE [Pinning ahead])."""
    cap = default_cap_bytes() if max_pinned_bytes is None else max_pinned_bytes
    pin = torch.cuda.is_available()
    ahead = (DEFAULT_PREPIN_AHEAD if pin else 0) if prepin_ahead is None else prepin_ahead
    return PinnedBufferPool(cap, pin=pin, prepin_ahead=ahead)


def _identity(t: torch.Tensor) -> tuple:
    """What makes two packed tensors the same one (deduplication). The storage's start from data_ptr, not
    t.untyped_storage(): a Python storage object, once made, stays attached to the storage and counts as one
    more user of it (policy.sole_owner reads that count)."""
    base = t.data_ptr() - t.storage_offset() * t.element_size()
    return base, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version


# NOTE [One offload at a time]
# Invariant: no tensor is offloaded twice. ``torch.autograd.graph.save_on_cpu`` pushed around a checkpoint call
# (transformers' ``activation_checkpointing_enable(offload=True)`` wraps every checkpoint in one; users push their
# own) sees exactly what this library's offload would: the checkpoint's inputs (NOTE [What the outer hook sees]).
# Rule: the outer one acts and ours steps aside for that call, with one WARNING line on rank 0 saying which offload
# acts. The checkpoint swap runs inside the outer context (it is entered before CheckpointFunction.apply), so a
# swapped checkpoint keeps it.
# Test: tests/test_offload_outer.py::test_one_offload_acts_and_gradients_equal_no_offload
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §16
SAVE_ON_CPU_PACK = "save_on_cpu.__init__.<locals>.pack_to_cpu"


def outer_save_on_cpu() -> bool:
    """The saved-tensor hooks on top of the stack are a ``save_on_cpu``'s (False where torch cannot say)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    return hooks is not None and getattr(hooks[0], "__qualname__", "") == SAVE_ON_CPU_PACK


def say_outer_offload_acts() -> None:
    ours = ("steps aside for these checkpoints so that no tensor is copied twice (drop offload=True from "
            "activation_checkpointing_enable to use this library's overlapped offload instead)"
            if current() is not None else "is off")
    log_rank0_once("offload-outer-save-on-cpu", logging.WARNING,
                   "ddp_patches: checkpoints run inside torch.autograd.graph.save_on_cpu (transformers' "
                   "activation_checkpointing_enable(offload=True), or the caller's own): that offload moves their "
                   "inputs to host memory, also where the checkpoint swap made them non-reentrant; this library's "
                   "offload %s. NOTE [One offload at a time] in ddp_patches/offload/offloader.py", ours)


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


# NOTE [What the outer hook sees]
# Invariant: hooks pushed around a whole non-reentrant checkpoint call see exactly its inputs once -- a decoder
# layer's input hidden states, what non-reentrant checkpointing keeps on the device between forward and backward --
# and nothing recomputed, and what the checkpoint computes is unchanged. Why: the checkpoint saves its positional
# tensor inputs before it pushes its own ``_checkpoint_hook``; everything the region saves afterwards goes to that
# inner hook, and saved_tensors_hooks form a stack whose top alone is called.
# Rule: wrap the generator ``checkpoint()`` looks up as a module global at call time, which reaches every
# non-reentrant call (transformers' layers, the calls the swap converts, user code); delegate with ``yield from``,
# so our hooks are pushed before and popped after the checkpoint's own (balanced also when the region raises).
# Push nothing when another saved-tensor hook is on top (an outer checkpoint, whose frame owns nested inputs; the
# user's ``save_on_cpu``; a backward's recompute), and let ``pack`` return its input untouched during a backward.
# Tests: tests/test_offload.py::test_inert_during_backward_and_inside_an_outer_checkpoint and the ``outer-hook``
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
# probe (tests/test_probes.py::test_every_assumption_holds_on_this_torch)
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


def target() -> str:
    """The name install() patches: the generator checkpoint() is seen to call
    (NOTE [Which generator checkpoint() calls])."""
    return f"torch.utils.checkpoint.{offload_probes.generator_name()}"


def install(*, explicit: bool, min_bytes: int, max_pinned_bytes: int | None,
            prefetch_depth: int = DEFAULT_PREFETCH_DEPTH, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> list[str]:
    if versions.offload_unsupported_reason() is None and not probes.verify(
            "offload", offload_probes.ASSUMPTIONS, "Checkpoint inputs stay on the device (no offload)"):
        return []  # NOTE [Probed assumptions]
    offloader = CheckpointInputOffloader(min_bytes=min_bytes, max_pinned_bytes=max_pinned_bytes, explicit=explicit,
                                         prefetch_depth=prefetch_depth, max_in_flight=max_in_flight)
    if explicit and offloader._no_cuda:
        offloader._inert("no-cuda", NO_CUDA)  # say it at apply(), not only at the first checkpoint
    name = offload_probes.generator_name() if versions.offload_unsupported_reason() is None else TARGET.rsplit(".")[-1]
    REGISTRY.install(torch_checkpoint, name, _make_offloading_generator)
    _active["offloader"] = offloader
    REGISTRY.add_handle(_Uninstall())
    return [f"torch.utils.checkpoint.{name}", *_patch_bound_copies()]


# NOTE [Modules that imported the generator by name]
# Invariant: offload reaches a checkpoint whatever module runs it, also one that bound the generator by name.
# torch.distributed._composable.checkpoint_activation (the composable ``checkpoint(module)`` FSDP2 users apply per
# block) does ``from torch.utils.checkpoint import _checkpoint_without_reentrant_generator`` (``..._impl`` on newer
# torch) and holds it under its own global; transformers + peft import it before the usual apply().
# Rule: apply() also wraps that module's copy when the module is already imported; one imported later binds the
# wrapped global of torch.utils.checkpoint by itself.
# Test: tests/test_offload_composable.py::test_composable_checkpoint_imported_before_apply_is_offloaded
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
BOUND_COPIES = ("torch.distributed._composable.checkpoint_activation",)


def _patch_bound_copies() -> list[str]:
    patched = []
    for module_name in BOUND_COPIES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in offload_probes.GENERATOR_NAMES:
            if vars(module).get(name) is vars(torch_checkpoint).get(name) is not None:
                continue  # it binds the global already wrapped (imported after apply())
            if name in vars(module):
                REGISTRY.install(module, name, _make_offloading_generator)
                patched.append(f"{module_name}.{name}")
    return patched


def stats() -> OffloadStats | None:
    """The last completed micro-step's offload accounting (None before the first one or when not applied)."""
    offloader = _active["offloader"]
    return None if offloader is None else offloader.last_step
