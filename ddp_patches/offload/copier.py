"""How offloaded checkpoint inputs cross between device and host: ``SyncCopier`` (in order), ``StreamCopier``
(CUDA side streams) and ``PrefetchedInput`` (NOTE [Copies, streams and lifetimes]). A copier only moves bytes and
orders streams; it keeps no bookkeeping of its own, so a test can replace any one of its methods (the CUDA mutation
tests do) and see what breaks.
"""

from __future__ import annotations

import torch


class SyncCopier:
    """Copies in program order on the current stream (CPU tensors, CPU tests): nothing is ever in flight."""

    measures_stalls = False

    def to_host(self, source: torch.Tensor, host: torch.Tensor):
        """Start copying ``source`` into ``host``; returns the token ``release`` needs (here: nothing)."""
        host.copy_(source)
        return None

    def release(self, source: torch.Tensor, event) -> None:
        """Called just before the last reference to ``source`` is dropped: after this, the compute stream may
        reuse its memory."""

    def to_device(self, host: torch.Tensor, out: torch.Tensor):
        out.copy_(host)
        return None  # no event: the data is there

    def wait(self, tensor: torch.Tensor, event) -> None:
        """Make the compute stream wait until ``tensor``, filled by ``to_device``, is there."""

    def stall_ms(self) -> float:
        return 0.0


# NOTE [Copies, streams and lifetimes]
# Invariant: no device block is reused while a copy still reads or writes it, and an offloaded input's block goes
# back to the compute stream once its copy out is done, without waiting for the CPU to notice.
# Rule (CUDA): pack starts the device-to-host copy into a pooled pinned buffer on one side stream per device, which
# first waits for the compute stream. A handle keeps its device tensor while the copy may be in flight (the last
# ``max_in_flight`` regions); when a new region begins, the compute stream waits *on the GPU* for the older copies'
# events and the handles drop their device tensors, so the caching allocator hands the blocks straight back and
# stream order makes the reuse safe (``record_stream`` would hold a block until the *CPU* saw the event, too late
# when the CPU runs ahead); the wait also bounds a forward that outruns the bus. A copy in fills a tensor allocated
# on the compute stream, after the kernels enqueued so far; the compute stream waits on its event before use, and
# an unused prefetch makes it wait before the block is reused (``PrefetchedInput``). A restored tensor lives on its
# handle until autograd frees it: a shared input crosses the bus once each way per step. Without CUDA,
# ``SyncCopier`` copies in order into ordinary host memory; ``non_blocking`` never meets pageable memory.
# Tests: tests/test_offload_cuda.py::test_race_stress_fails_when_a_stream_dependency_is_removed and
# tests/test_offload_cuda.py::test_device_memory_released_while_the_cpu_runs_ahead; Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
class StreamCopier(SyncCopier):
    """Asynchronous copies on one side stream per CUDA device; tensors on other devices (the CPU-path tests, run
    on a GPU host) are copied in order, as by ``SyncCopier``.

    ``measure_stalls=True`` times, with CUDA events, how long the compute stream sat at ``wait`` for a copy in:
    the GPU-side cost that the CPU-side count of late copies (``stats.waited``) cannot see. Off by default (two
    timing events per restored input); the benchmarks turn it on.
    """

    def __init__(self, measure_stalls: bool = False) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.measures_stalls = measure_stalls
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._stall_ms = 0.0

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=self.measures_stalls)

    def to_host(self, source: torch.Tensor, host: torch.Tensor):
        if source.device.type != "cuda":
            return super().to_host(source, host)
        side = self.stream(source.device)
        compute = torch.cuda.current_stream(source.device)
        side.wait_stream(compute)  # the copy reads a finished tensor
        with torch.cuda.stream(side):
            host.copy_(source, non_blocking=True)
            done = self._event()
            done.record(side)
        return done, compute

    def release(self, source: torch.Tensor, token) -> None:
        # The stream that was current when the tensor was packed (the one its block goes back to) waits, on the
        # GPU, for the copy; then the caller drops ``source``: the caching allocator hands the block to the next
        # allocation at once, and stream order makes that safe. record_stream would instead hold the block
        # until the *CPU* saw the copy finish, which a CPU running far ahead of the GPU does not see in time.
        if token is not None:
            event, stream = token
            stream.wait_event(event)

    def to_device(self, host: torch.Tensor, out: torch.Tensor):
        if out.device.type != "cuda":
            return super().to_device(host, out)
        side = self.stream(out.device)
        # ``out`` was just allocated on the compute stream and may reuse a block that kernels enqueued so far
        # still read: the copy must start after them, and "everything enqueued so far" is exactly that point.
        compute = torch.cuda.current_stream(out.device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            out.copy_(host, non_blocking=True)
            done = self._event()
            done.record(side)
        return done, compute  # ``release`` of an unused prefetch waits on the stream ``out`` belongs to

    def wait(self, tensor: torch.Tensor, token) -> None:
        if token is None:
            return
        event = token[0]
        compute = torch.cuda.current_stream(tensor.device)  # the stream about to use the tensor
        if self.measures_stalls:
            ready = self._event()
            ready.record(compute)
            self._timed.append((ready, event))
        compute.wait_event(event)

    def stall_ms(self) -> float:
        """GPU time the compute stream spent waiting for copies in, over the pairs whose events have completed."""
        pending = []
        for ready, done in self._timed:
            if ready.query() and done.query():
                self._stall_ms += max(0.0, ready.elapsed_time(done))
            else:
                pending.append((ready, done))
        self._timed = pending
        return self._stall_ms


class PrefetchedInput:
    """A device tensor a prefetch is filling. Dropped unconsumed (the backward raised, the graph was freed), it
    first makes the stream it was allocated on wait for its copy (whatever thread drops it), so its block is not
    handed out while the copy still writes it -- the job ``record_stream`` did, without holding the block until
    the CPU sees the copy end."""

    __slots__ = ("tensor", "event", "copier")

    def __init__(self, tensor: torch.Tensor, event, copier: SyncCopier) -> None:
        self.tensor, self.event, self.copier = tensor, event, copier

    def take(self) -> torch.Tensor:
        """The tensor, once the compute stream waits for it; this object no longer guards it."""
        self.copier.wait(self.tensor, self.event)
        tensor, self.tensor, self.event = self.tensor, None, None
        return tensor

    def __del__(self) -> None:
        if self.tensor is not None and self.event is not None:
            try:
                self.copier.release(self.tensor, self.event)
            except Exception:  # interpreter shutdown: CUDA may be gone; nothing can reuse the block then
                pass
