"""What the simulation counts: ``LiveBytes``, a dispatch mode that adds up the bytes of every storage created in a
step that is still alive, with the peak and where it was; and FlashAttention-2's backward workspace, which the CPU
kernel does not allocate (NOTE [What the simulation models])."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

# NOTE [What the simulation models]
# Fake tensors run on the CPU device (a CUDA build's fake "cuda" device asks for a device context in backward), so
# what differs by device is modelled, not run:
#   * offload (CUDA only): a layer's input counts as host bytes from the end of its forward until its recompute,
#     when it and the previous layer's input (prefetch 1) count on the device again; the first layer's input (a
#     leaf that requires grad) and the last stay, as the offloader keeps them.
#   * attention: SDPA on fake CPU tensors runs the CPU flash kernel, which saves q, k, v (GQA's k/v unrepeated),
#     the output and the log-sum-exp, as FlashAttention-2 does; its backward adds FA2's workspace while it runs
#     (``flash_backward_workspace``). The model runs ``ATTENTION``, transformers' SDPA with a mask function that
#     returns None (a GPU run without padding builds no S x S mask: SDPA's is_causal).
#   * the fused head: TRL folds each logits tile with one in-place Triton kernel on a GPU, which allocates
#     nothing: its CPU fold (float32 temporaries, results written in place) is not run (``_gpu_folds``).
#   * the allocator: live bytes, not what a caching allocator reserves; ``plan`` keeps a margin for that.
# Test: tests/test_memsim.py::test_calibration_offload_gpu_bound (against the H100 run in docs/data/gpu-proof.json).
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §13


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive, by place ("device" or "host"), with peaks."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.record = record  # keep what made each storage, and the storages alive at the device peak
        self._made: dict = {}  # id(storage) -> (op, dtype, shape, where, [nbytes, place]) while it lives
        self._at_peak: list = []
        self._info: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [nbytes, place]
        self._refs: set = set()
        self.current = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self._paused = 0
        self.pinned = 0  # pinned host bytes taken by offload (size classes), set by ``_offloading``
        self.phase = "embedding"  # set by the caller's hooks: "layer" or "head"
        self.peak_phase = self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        peak = self.peak["device"]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no pytree walk (a few % of a plan's time)
            self._track(out, func)
        else:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._track(t, func)
        extra = []
        if func in _FLASH_BACKWARD and not self._paused:  # its workspace, beside its outputs while it runs
            workspace = flash_backward_workspace(args[1], args[2])
            self._add("device", workspace)
            self.current["device"] -= workspace
            extra = [(workspace, "FlashAttention-2 backward workspace (modelled)", torch.float32, (), "")]
        if self.record and self.peak["device"] > peak:
            self._snapshot(extra)
        return out

    def _snapshot(self, extra: list = ()) -> None:
        self._at_peak = [(info[0], op, dtype, shape, where) for op, dtype, shape, where, info in self._made.values()
                         if info[1] == "device"] + list(extra)

    def peak_listing(self) -> list:
        """With ``record``: (bytes, op, dtype, shape, where made) of each storage alive at the device peak, largest
        first (a debugging aid: what a peak is made of)."""
        return sorted(self._at_peak, key=lambda row: -row[0])

    def exclude(self, tensors) -> None:
        """Storages that exist before the step (parameters, buffers, inputs): never counted, nor their views."""
        for t in tensors:
            self._info[t.untyped_storage()] = [0, "device"]

    @contextlib.contextmanager
    def uncounted(self):
        """Storages made inside are not counted (work a GPU kernel does in place)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _track(self, t: torch.Tensor, func=None) -> None:
        storage = t.untyped_storage()
        if storage in self._info:
            return
        # an untracked storage seen through a view was made before the step (a weight's transpose): not counted
        info = [0 if t._is_view() or self._paused else storage.nbytes(), "device"]
        self._info[storage] = info
        key = id(storage)
        if self.record and info[0]:
            self._made[key] = (str(func), t.dtype, tuple(t.shape), _where(), info)
        self._add(info[1], info[0])

        def gone(ref, info=info, key=key):
            self._refs.discard(ref)
            self._made.pop(key, None)
            self.current[info[1]] -= info[0]

        self._refs.add(weakref.ref(storage, gone))

    def _add(self, place: str, nbytes: int) -> None:
        self.current[place] += nbytes
        if self.current[place] > self.peak[place]:
            self.peak[place] = self.current[place]
            if place == "device":
                self.peak_phase = self.phase

    def move(self, t: torch.Tensor, place: str) -> int:
        """Count ``t``'s storage at ``place`` from now on; the bytes moved (0 if untracked or already there)."""
        info = self._info.get(t.untyped_storage())
        if info is None or info[1] == place:
            return 0
        self.current[info[1]] -= info[0]
        info[1] = place
        peak = self.peak["device"]
        self._add(place, info[0])
        if self.record and self.peak["device"] > peak:
            self._snapshot()
        return info[0]


def _where() -> str:
    """The innermost frames of the model's and the library's code that made a storage (``LiveBytes(record=True)``)."""
    import sys

    frame, found = sys._getframe(2), []
    while frame is not None and len(found) < 3:
        name = frame.f_code.co_filename
        if any(k in name for k in ("transformers", "peft", "trl", "ddp_patches")) and not name.endswith("memsim.py"):
            found.append(f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(found)


_FLASH_BACKWARD = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,)


def flash_backward_workspace(query: torch.Tensor, key: torch.Tensor) -> int:
    """The bytes FlashAttention-2's backward (``mha_bwd``, also PyTorch's SDPA flash kernel) allocates beside its
    outputs: ``dq_accum`` in float32 (query rows rounded up to 128, head size to 32) and, where key/value have fewer
    heads (GQA), dk and dv expanded to the query's heads (NOTE [What the simulation models])."""
    batch, heads, rows, head = query.shape
    workspace = batch * heads * -(-rows // 128) * 128 * -(-head // 32) * 32 * 4 + batch * heads * rows * 4
    if key.shape[1] != heads:
        workspace += 2 * batch * key.shape[2] * heads * head * query.element_size()
    return workspace
