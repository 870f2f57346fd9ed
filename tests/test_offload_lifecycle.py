"""Offload you can trust (issue: in-place edits, release timing, shared inputs, step boundaries, old torch,
several devices), each through the real pack/unpack path on CPU with the injected predicate."""

from __future__ import annotations

import contextlib
import logging
import random
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ddp_patches
from ddp_patches import versions
from ddp_patches.offload import offloader as offload
from ddp_patches.offload.pinned_pool import size_class
from ddp_patches.verify.cpu_offload import forced, offloading
from ddp_patches.verify.raw_models import CheckpointStack




def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


# -- 1. in-place edits after pack --------------------------------------------------------------------------------
def inplace_case(edit_index: int):
    blocks = [nn.Linear(16, 16).double() for _ in range(3)]
    h = torch.randn(4, 16, dtype=torch.float64, requires_grad=True) * 1.0
    inputs, out = [], h
    for block in blocks:
        inputs.append(out)
        out = checkpoint(block, out, use_reentrant=False)
    inputs[edit_index].mul_(-3.0)  # an in-place edit of a checkpoint input after its checkpoint ran
    out.sum().backward()


@pytest.mark.parametrize("edit_index", [0, 2], ids=["offloaded-input", "kept-last-input"])
def test_inplace_edit_after_pack_raises_autograds_error(edit_index):
    with ddp_patches.patched(), pytest.raises(RuntimeError, match="modified by an inplace operation"):
        inplace_case(edit_index)  # what torch says without offload
    with offloading(forced()), pytest.raises(RuntimeError, match="modified by an inplace operation"):
        inplace_case(edit_index)  # and with it: no silently wrong gradient


def test_version_witness_follows_views_and_holds_no_memory():
    x = torch.randn(1000)
    witness = offload.version_witness(x)
    view = x[:10]
    del x
    view.add_(1)  # through a view, after the base tensor object is gone
    assert witness._version == 1 and witness.untyped_storage().nbytes() == 0


# -- 2. device memory released on the GPU's timeline, and a bounded number of copies in flight ---------------------
class InFlightCopier(offload.SyncCopier):
    """Models a GPU-bound run: every copy out stays in flight until ``release`` is called for it, and a device
    tensor must not be dropped before that (the compute stream's wait on the copy, on a GPU)."""

    def __init__(self):
        self.started: list[int] = []
        self.released: list[int] = []

    def to_host(self, source, host):
        super().to_host(source, host)
        self.started.append(id(source))
        return id(source)  # the "event"

    def release(self, source, event):
        assert event == id(source)  # the compute stream waits on *this* tensor's copy before it is dropped
        self.released.append(event)


def test_copies_start_at_pack_and_device_tensors_are_released_a_region_later():
    copier = InFlightCopier()
    held_after_each_region = []
    with offloading(forced(copier=copier)) as off:
        h = torch.randn(8, 32) * 2
        for block in [nn.Linear(32, 32) for _ in range(6)]:
            h = checkpoint(block, h, use_reentrant=False)
            held_after_each_region.append(sum(x.source is not None for x in off.live_handles()))
            assert len(copier.started) == len(held_after_each_region)  # the copy out started at its own pack
        h.sum().backward()
    assert held_after_each_region == [1] * 6  # only the current region's input: the window is one region deep
    assert copier.released == copier.started[:5]  # in order, each after its copy; the last input never left


def test_a_deeper_window_holds_more_regions():
    copier = InFlightCopier()
    with offloading(forced(copier=copier, max_in_flight=3)) as off:
        h = torch.randn(8, 32) * 2
        for block in [nn.Linear(32, 32) for _ in range(6)]:
            h = checkpoint(block, h, use_reentrant=False)
        assert sum(x.source is not None for x in off.live_handles()) == 3
        h.sum().backward()
    assert off.stats.offloaded_tensors == 3 and off.stats.kept_last == 3


def test_a_view_of_a_live_tensor_is_moved_but_never_counted_as_freed():
    """NOTE [What is never offloaded]: the caller keeps the base alive, so dropping the view frees nothing."""
    torch.manual_seed(0)
    blocks = [nn.Linear(16, 16).double() for _ in range(3)]
    base = torch.randn(16, 16, dtype=torch.float64) * 2
    with offloading(forced()) as off:
        h = checkpoint(blocks[0], base[:8], use_reentrant=False)  # a (dense) view of ``base``, which stays alive
        for block in blocks[1:]:
            h = checkpoint(block, h, use_reentrant=False)
        h.sum().backward()
    assert off.stats.kept[offload.SHARED] == 1 and off.stats.offloaded_tensors == 1
    # the view object itself died with the forward (only its storage lives on in ``base``), so backward copies
    # it back: 2 copies in, one of them a duplicate of memory that never left -- the cost of not keeping views
    assert off.stats.copies_in == 2


def test_hidden_states_kept_by_the_caller_are_not_counted_as_offloaded():
    """The ``output_hidden_states`` pattern: a list holds every layer input for the whole step."""
    torch.manual_seed(0)
    blocks = [nn.Linear(16, 16).double() for _ in range(4)]
    with offloading(forced()) as off:
        h, kept = torch.randn(8, 16, dtype=torch.float64) * 2, []
        for block in blocks:
            kept.append(h)
            h = checkpoint(block, h, use_reentrant=False)
        h.sum().backward()
    assert off.stats.offloaded_tensors == 0 and off.stats.kept[offload.SHARED] == 3
    assert off.stats.copies_in == 0  # served from the live tensors, not copied back


# -- 3. a tensor shared by several checkpoints crosses the bus once each way ---------------------------------------
def test_shared_input_is_copied_out_once_and_back_once():
    torch.manual_seed(0)
    blocks = [nn.Linear(32, 32).double() for _ in range(6)]

    def layer(block, h, mask):
        return block(h) * mask

    def run():
        torch.manual_seed(1)
        for b in blocks:
            b.zero_grad(set_to_none=True)

        def forward():  # like a model's forward: the mask lives until the forward returns, not into backward
            h = torch.randn(8, 32, dtype=torch.float64) * 2
            mask = torch.rand(8, 32, dtype=torch.float64).exp()  # passed positionally to every layer
            for b in blocks:
                h = checkpoint(layer, b, h, mask, use_reentrant=False)
            return h.sum()

        forward().backward()
        return [p.grad.clone() for b in blocks for p in b.parameters()]

    with ddp_patches.patched():
        expected = run()
    with offloading(forced()) as off:
        got = run()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    s = off.stats
    assert s.deduplicated == 5  # the mask is packed once
    assert s.offloaded_tensors == 5  # 5 hidden states (the last one stays)
    assert s.kept[offload.SHARED] == 1  # the mask: the forward still held it when released, so that freed nothing
    assert s.copies_in == 6 and s.restored_again == 5  # the mask came back once and served five more layers
    assert s.copies_in == s.prefetched + s.waited  # every copy was used: no prefetch thrown away
    assert s.waited == 1  # the mask's first use (at the last layer) is the one copy not started ahead


# -- 5. step boundaries --------------------------------------------------------------------------------------------
def test_gradient_penalty_inside_forward_does_not_split_the_step():
    torch.manual_seed(0)
    model = CheckpointStack(depth=4).double()
    x = torch.randn(8, 20, dtype=torch.float64, requires_grad=True)

    def step():
        model.zero_grad(set_to_none=True)
        h = model.inp(x)
        for i, block in enumerate(model.blocks):
            h = h + checkpoint(block, h, use_reentrant=False)
            if i == 1:  # a gradient penalty computed in the middle of the forward
                (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
                h = h + 1e-3 * g.pow(2).sum()
        h.pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    with ddp_patches.patched():
        expected = step()
    with offloading(forced()) as off:
        got = step()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert off.stats.offloaded_tensors == 3 and off.stats.kept_last == 1  # the step was not split
    assert off.last_step is None  # still one window


def test_two_forwards_then_one_backward():
    torch.manual_seed(0)
    model = CheckpointStack(depth=4).double()
    a, b = torch.randn(8, 20, dtype=torch.float64), torch.randn(8, 20, dtype=torch.float64)

    def step():
        model.zero_grad(set_to_none=True)
        (model(a).pow(2).mean() + model(b).pow(2).mean()).backward()
        return [p.grad.clone() for p in model.parameters()]

    with ddp_patches.patched():
        expected = step()
    with offloading(forced()) as off:
        got = step()
        got_again = step()
    assert all(torch.equal(x, y) for x, y in zip(expected, got))
    assert all(torch.equal(x, y) for x, y in zip(expected, got_again))
    assert off.last_step.offloaded_tensors == 7  # 8 inputs over two forwards; the very last one stays
    assert off.pool.in_use_bytes == 0


class Boom(Exception):
    pass


def test_backward_that_raises_midway_then_training_continues():
    torch.manual_seed(0)
    blocks = [nn.Linear(20, 20).double() for _ in range(4)]
    x = torch.randn(8, 20, dtype=torch.float64)

    def forward(fail: bool):
        h = x * 2
        for i, block in enumerate(blocks):
            h = checkpoint(block, h, use_reentrant=False)
            if fail and i == 1:  # raises when backward reaches here: after the last two layers were recomputed
                h.register_hook(lambda g: (_ for _ in ()).throw(Boom()))
        return h.pow(2).mean()

    def step():
        for b in blocks:
            b.zero_grad(set_to_none=True)
        forward(False).backward()
        return [p.grad.clone() for b in blocks for p in b.parameters()]

    with ddp_patches.patched():
        expected = step()
    with offloading(forced()) as off:
        with pytest.raises(Boom):
            forward(True).backward()
        got = step()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert off.pool.in_use_bytes == 0  # the aborted step's buffers came back
    assert off.last_step.offloaded_tensors == 3 and off.stats.offloaded_tensors == 3  # one window each


def test_forwards_never_followed_by_a_backward_keep_bookkeeping_bounded():
    torch.manual_seed(0)
    model = CheckpointStack(depth=4).double()
    x = torch.randn(8, 20, dtype=torch.float64)
    with offloading(forced()) as off:
        for _ in range(50):
            model(x)  # the output is dropped: autograd frees the saved inputs
        assert len(off.window.order) <= 8 and len(off.window.by_key) <= 8  # pruned, not 50 forwards' worth
        assert off.pool.peak_in_use_bytes == 4 * size_class(8 * 20 * 8)  # one forward's buffers at a time
        assert off.stats.offloaded_tensors == 150  # still offloaded every forward


def test_evaluation_under_no_grad_between_steps_and_two_models():
    torch.manual_seed(0)
    first, second = CheckpointStack(depth=4).double(), CheckpointStack(depth=3).double()
    x = torch.randn(8, 20, dtype=torch.float64)
    with ddp_patches.patched():
        expected = (grads(first, x), grads(second, x))
    with offloading(forced()) as off:
        got_first = grads(first, x)
        with torch.no_grad():
            first(x), second(x)  # evaluation: nothing packed
        evaluated = off.stats.offloaded_tensors
        got_second = grads(second, x)
    assert all(torch.equal(a, b) for a, b in zip(expected[0], got_first))
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got_second))
    assert evaluated == 3 and off.stats.offloaded_tensors == 2  # the second model's own window


# -- 4. a failed pinned allocation inside forward -------------------------------------------------------------------
def test_failed_pinned_allocation_keeps_the_tensor_with_one_warning(caplog):
    from ddp_patches.offload.pinned_pool import PinnedBufferPool

    def refuse(n):
        raise RuntimeError("CUDA error: out of memory")

    torch.manual_seed(0)
    model = CheckpointStack(depth=4).double()
    x = torch.randn(8, 20, dtype=torch.float64)
    with ddp_patches.patched():
        expected = grads(model, x)
    pool = PinnedBufferPool(1 << 30, pin=False, allocate=refuse)
    with caplog.at_level(logging.WARNING, logger="ddp_patches"), offloading(forced(pool=pool)) as off:
        got = grads(model, x)
        grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert off.last_step.kept[offload.PINNED_FAILED] == 4 and off.last_step.offloaded_tensors == 0  # all four ask at pack
    assert off.last_step.kept_last == 0  # counted once, as a failed pin (the old code counted it twice)
    assert sum("pinned host allocation failed" in r.getMessage() for r in caplog.records) == 1


# -- 6. torch without the hook-stack API ----------------------------------------------------------------------------
def test_offload_states_its_minimum_torch(monkeypatch):
    assert versions.OFFLOAD_MINIMUM_TORCH == (2, 8)
    assert "needs torch >= 2.8 (found 2.7.1)" in versions.offload_unsupported_reason("2.7.1")
    assert versions.offload_unsupported_reason("2.13.0") is None
    monkeypatch.setattr(versions, "offload_unsupported_reason", lambda *a: "offload needs torch >= 2.8 (found 2.7.1)")
    report = ddp_patches.apply(offload=True)
    assert "offload needs torch >= 2.8" in str(report) and report.notes
    ddp_patches.revert()
    assert not [n for n in ddp_patches.apply(offload=False).notes if "offload" in n]  # nothing to say when it is off


def test_doctor_names_the_offload_minimum():
    from ddp_patches.doctor import _version_findings

    found = _version_findings({"torch": "2.7.1", "transformers": "5.23.0"})
    assert [f.code for f in found] == ["offload-needs-newer-torch"]


# -- 7. several devices in one process -----------------------------------------------------------------------------
def test_copies_and_buffers_are_kept_per_device(monkeypatch):
    """The bookkeeping side of a model split over devices: each handle's buffer comes from its device's free list
    (tests/test_offload_cuda.py runs the streams on real GPUs where there are two)."""
    seen = []
    off = forced()
    real_acquire = off.pool.acquire
    monkeypatch.setattr(off.pool, "acquire", lambda n, device=None: seen.append(device) or real_acquire(n, device))
    with offloading(off):
        h = torch.randn(4, 32) * 2
        for block in [nn.Linear(32, 32) for _ in range(3)]:
            h = checkpoint(block, h, use_reentrant=False)
        h.sum().backward()
    assert seen == [torch.device("cpu")] * 3  # the tensor's own device keys the free list


def test_stream_copier_copies_non_cuda_tensors_in_order():
    """On a GPU host the default copier is the stream one; CPU tensors (the CPU-path tests) must not reach CUDA."""
    torch.manual_seed(0)
    model = CheckpointStack(depth=4).double()
    x = torch.randn(8, 20, dtype=torch.float64)
    with ddp_patches.patched():
        expected = grads(model, x)
    with offloading(forced(copier=offload._StreamCopier())) as off:
        got = grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert off.stats.offloaded_tensors == 3 and not off.copier._streams


# -- 8. inputs whose bytes are not all of them (adversarial review) ------------------------------------------------
def _two_region_grads(make_input, region):
    torch.manual_seed(0)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    h = make_input()
    y = checkpoint(lambda t: region(t, w), h, use_reentrant=False)
    y = checkpoint(lambda t: t * 1.0, y, use_reentrant=False)  # a second region releases the first input
    del h
    y.sum().backward()
    return w.grad.clone()


@pytest.mark.parametrize("case", ["wrapper-subclass", "non-dense-view", "sparse-csr", "nested-jagged"])
def test_inputs_that_cannot_round_trip_stay_on_the_device(case):
    """A wrapper subclass copied into a plain buffer came back plain (gradient 10.9 off, no error); a non-dense
    view came back contiguous (reductions in another order); sparse and nested inputs crashed in pack, and the
    nested one leaked its pool buffer. They now stay where they are, counted as kept."""
    from torch.testing._internal.two_tensor import TwoTensor

    def make():
        if case == "wrapper-subclass":
            return TwoTensor(torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)) * 2
        if case == "non-dense-view":
            return (torch.randn(4, 32, dtype=torch.float64) * 2)[:, ::2]
        if case == "sparse-csr":
            return (torch.randn(4, 16, dtype=torch.float64) * 2).to_sparse_csr()
        return torch.nested.nested_tensor([torch.randn(3, 16, dtype=torch.float64),
                                           torch.randn(5, 16, dtype=torch.float64)], layout=torch.jagged) * 2

    def region(t, w):
        if case == "sparse-csr":
            return (t @ torch.eye(16, dtype=torch.float64)) * w
        if case == "nested-jagged":
            return t * w
        return t * w * t.sum(-1, keepdim=True)

    with ddp_patches.patched():
        expected = _two_region_grads(make, region)
    with offloading(forced()) as off:
        got = _two_region_grads(make, region)
    assert torch.equal(expected, got)
    reason = offload.NON_DENSE if case == "non-dense-view" else offload.NOT_PLAIN
    assert off.stats.kept[reason] >= 1 and off.pool.in_use_bytes == 0


# -- 9. any unpack order (torch leaves the order of unpacking saved tensors unspecified) -----------------------------
def _orders(n: int) -> dict:
    shuffled = list(range(n))
    random.Random(0).shuffle(shuffled)
    return {"forward": list(range(n)), "random": shuffled, "reverse": list(range(n))[::-1]}


def _any_order_run(blocks, order: list[int], watch=None, shape=(8, 16), device=None) -> list[torch.Tensor]:
    """Per-layer gradients taken one region at a time in ``order`` (each ``autograd.grad`` unpacks exactly that
    region's input), with a full backward under retain_graph halfway through and a last one freeing the graph."""
    torch.manual_seed(3)
    h = torch.randn(*shape, dtype=torch.float64, device=device) * 2
    losses = []
    for block in blocks:  # only scalars are kept: every layer input is held by its saved-tensor handle alone
        h = checkpoint(lambda t, b=block: b(t).tanh(), h, use_reentrant=False)
        losses.append(h.sum() * 1.0)
    del h
    got = []
    for step, k in enumerate(order):
        got += torch.autograd.grad(losses[k], list(blocks[k].parameters()), retain_graph=True)
        if watch is not None:
            watch()
        if step == len(order) // 2:  # a second backward of the same graph, interleaved
            got += torch.autograd.grad(sum(losses), list(blocks.parameters()), retain_graph=True)
    got += torch.autograd.grad(sum(losses), list(blocks.parameters()))  # frees the graph
    return got


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("order_name", ["forward", "random", "reverse"])
def test_any_unpack_order_gives_exact_gradients_and_bounded_copies(order_name, depth):
    """Values are right whatever the order; prefetched tensors waiting for their unpack never exceed
    ``prefetch_depth`` (a wrong guess is dropped, not piled up); every input crosses back at most once unless a
    dropped guess is needed later; nothing is held once the graph is freed."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(16, 16).double() for _ in range(8))
    order = _orders(len(blocks))[order_name]
    with ddp_patches.patched():
        expected = _any_order_run(blocks, order)
    off = forced(prefetch_depth=depth)
    waiting = []
    with offloading(off):
        got = _any_order_run(blocks, order,
                             watch=lambda: waiting.append(sum(h.prefetched is not None for h in off.live_handles())))
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(expected, got))
    s = off.last_step or off.stats
    assert max(waiting) <= depth, f"{max(waiting)} prefetched tensors waiting at once, prefetch_depth {depth}"
    assert s.offloaded_tensors == 7 and s.kept_last == 1  # 8 inputs, the last still in the in-flight window
    assert s.copies_in == s.prefetched + s.waited + s.prefetch_dropped  # every copy in is used or dropped
    assert s.prefetched + s.waited == 7  # each offloaded input was brought back exactly once
    assert s.copies_in <= 7 + s.prefetch_dropped
    if order_name == "reverse":
        assert s.waited == 0 and s.prefetch_dropped == 0  # the order the prefetch guesses: all ahead, none wasted
    assert not off.live_handles() and off.pool.in_use_bytes == 0  # graph freed: no tensor or buffer held


# -- 10. step 1 does not pay for pinning (NOTE [Pinning ahead] in pinned_pool.py) -------------------------------------
def test_step_one_packs_find_buffers_pinned_ahead_and_the_cap_holds():
    from ddp_patches.offload.pinned_pool import PinnedBufferPool

    inside, ahead = [], []

    def allocate(n):  # which thread pinned it: the forward's (inside a pack) or the pinning-ahead one
        (inside if threading.current_thread() is threading.main_thread() else ahead).append(n)
        return torch.empty(n, dtype=torch.uint8)

    torch.manual_seed(0)
    model = CheckpointStack(depth=6).double()
    one = size_class(8 * 20 * 8)
    pool = PinnedBufferPool(7 * one, pin=False, allocate=allocate, prepin_ahead=2)
    for block in model.blocks:  # each layer's compute outlasts one pinning, as on a GPU with large layers
        block.register_forward_pre_hook(lambda *_: pool.join_prepin())
    x = torch.randn(8, 20, dtype=torch.float64)
    with ddp_patches.patched():
        expected = grads(model, x)
    with offloading(forced(pool=pool)) as off:
        got = grads(model, x)
        first_step_inside = len(inside)
        grads(model, x)
        pool.join_prepin()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert first_step_inside == 1  # only the first pack of step 1 pinned on the forward's path; 5 found one ready
    assert len(inside) == 1 and off.last_step.pinned_allocations == 1 and off.last_step.prepinned >= 5
    assert pool.owned_bytes <= pool.cap_bytes == 7 * one  # 6 used, one more ahead: the cap, not prepin_ahead, bounds it
    assert len(ahead) == 6 and off.stats.offloaded_tensors == 5  # step 2 reused everything: nothing more pinned


# -- 11. a graph freed by the cyclic garbage collector (NOTE [Releases from a garbage collection] in pinned_pool.py) --
def _cycle_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A forward thrown away inside a reference cycle (an evaluation whose output an object in a cycle kept), then
    the step's own loss. The thrown-away graph's handles die only when the cyclic GC runs."""
    from ddp_patches.verify.raw_models import raw_loss

    holder = {"out": model(x[:, :-1] * 0.5)}
    holder["self"] = holder
    del holder
    return raw_loss(model, x)


def gc_cycle_case(with_library: bool) -> dict:
    """2 ranks, DDP over a checkpointed stack, different data per rank; every new host buffer starts a collection
    (as the Python tensor object a pinned allocation makes can), which frees the thrown-away graph while the pool
    is inside its own bookkeeping. Without the library it trains; with offload it must too (it hung), with the
    gradients of the single-process reference on the global batch."""
    import gc

    from ddp_patches.offload.pinned_pool import PinnedBufferPool
    from ddp_patches.verify.cpu_offload import cpu_path_offloader
    from ddp_patches.verify.parity import run_parity
    from ddp_patches.verify.raw_models import raw_batch

    def allocate(n: int) -> torch.Tensor:
        gc.collect()
        return torch.empty(n, dtype=torch.uint8)

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ddp_patches").addHandler(handler)
    pool = PinnedBufferPool(1 << 30, pin=False, allocate=allocate)
    off = cpu_path_offloader(pool=pool)  # gated as the default: distributed, under DDP
    gc.disable()  # collections happen only where allocate() starts them
    try:
        with offloading(off) if with_library else contextlib.nullcontext():
            parity = run_parity(lambda: CheckpointStack().double(), raw_batch, torch.cat, _cycle_loss, iters=2)
    finally:
        gc.enable()
        logging.getLogger("ddp_patches").removeHandler(handler)
    return {"parity": parity.as_dict(), "offloaded": off.stats.step > 1 or off.stats.offloaded_tensors > 0,
            "warnings": [w for w in warnings if "inert" not in w]}


@pytest.mark.parametrize("with_library", [False, True], ids=["without-library", "with-library"])
def test_graph_freed_by_a_gc_inside_the_pools_bookkeeping_does_not_hang(pool, with_library):
    for r in pool.run(gc_cycle_case, timeout=60, with_library=with_library):
        assert r["parity"]["max_rel_error"] < 1e-12 and r["parity"]["ranks_in_sync"], r
        assert r["offloaded"] == with_library and not r["warnings"], r
