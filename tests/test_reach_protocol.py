"""The library's count-all-reduce follows DDP's own collectives on every rank
(NOTE [One collective per reduction, on every rank]): Join with uneven inputs, a backward that reaches the parameters
but not the outputs, and no host read-back of the reduced counts where every parameter had a gradient.

Each rank function returns, per iteration it took part in, the relative gradient error against a single process
that runs the active ranks' batches (divided by the world size, as DDP's Join does by default), and whether each
gradient's None-ness matched; then the final parameters' distance from that single process.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import ddp_patches

W = 6


class _Net(torch.nn.Module):
    """A trunk, and a branch (a vision tower) that runs only when the batch's flag column is 1."""

    def __init__(self, branch: bool = True, one_tensor: bool = False):
        super().__init__()
        self.one_tensor = one_tensor
        if one_tensor:  # the 1-float count-all-reduce then has the size of Join's own 1-float all-reduce
            self.scale = torch.nn.Parameter(torch.ones(()))
        else:
            self.trunk = torch.nn.Linear(W, W)
            self.branch = torch.nn.Linear(W, W) if branch else None

    def forward(self, x):
        flag, x = x[:, -1:], x[:, :-1]
        if self.one_tensor:
            return x * self.scale
        out = self.trunk(x)
        if self.branch is not None and bool(flag.any()):
            out = out + self.branch(x) * flag
        return out


def _batch(rank: int, it: int, flag: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + it)
    x = torch.randn(3, W, generator=g, dtype=torch.float64)
    return torch.cat([x, torch.full((3, 1), float(flag), dtype=torch.float64)], dim=1)


def _loss(model, x):
    return model(x).pow(2).mean()


def _off_output_loss(model, x):
    """A rank with no valid target: every parameter keeps its hook firing, the outputs are not reached."""
    model(x)
    return sum(p.sum() for p in model.parameters()) * 0


def _reference_grads(ref: torch.nn.Module, contributions: list, world: int) -> list:
    ref.zero_grad(set_to_none=True)
    for loss_fn, x in contributions:
        loss_fn(ref, x).backward()
    return [None if p.grad is None else p.grad / world for p in ref.parameters()]


def _compare(model, expected: list) -> tuple[float, bool]:
    err, none_ok = 0.0, True
    for p, g in zip(model.parameters(), expected):
        if (p.grad is None) != (g is None):
            none_ok = False
        elif g is not None:
            err = max(err, ((p.grad - g).norm() / g.norm().clamp_min(1e-30)).item())
    return err, none_ok


def _plans(pattern: str, world: int) -> list[list]:
    """Per rank, the list of (loss function, branch flag) of its iterations."""
    if pattern == "join":  # rank 0 has one more batch than the others
        return [[(_loss, it % 2 == 0) for it in range(3 if r == 0 else 2)] for r in range(world)]
    if pattern == "join_branch_idle":  # the branch is used by rank 0 only, at its first step
        return [[(_loss, r == 0 and it == 0) for it in range(3 if r == 0 else 2)] for r in range(world)]
    if pattern == "plain":
        return [[(_loss, True) for it in range(3)] for r in range(world)]
    if pattern == "branch_idle":  # the branch is used by rank 0 at its first step only
        return [[(_loss, r == 0 and it == 0) for it in range(3)] for r in range(world)]
    if pattern == "off_output":  # rank 1 has nothing to learn from at step 1
        return [[(_off_output_loss if (r == 1 and it == 1) else _loss, True) for it in range(3)] for r in range(world)]
    raise ValueError(pattern)


def protocol_case(pattern: str, patched: bool, net: dict, ddp_kwargs: dict | None = None, accum: int = 1,
                  comm_hook: bool = False, manual_finalize: bool = False, no_sync_around: str = "both") -> dict:
    """``accum``: each step's batch runs ``accum`` times, all but the last under ``no_sync`` (the reference is
    then ``accum`` times the step's gradient); ``comm_hook``: DDP's fp16 compression hook (gradients rounded);
    ``manual_finalize``: torch >= 2.15's ``require_manual_backward_finalization``, ``finalize_backward()`` after
    each synced backward; ``no_sync_around``: what ``no_sync()`` wraps in the accumulation micro-steps: "both",
    "forward" (DDP then reduces nothing there: local accumulation) or "backward" (the synced forward prepared a
    reduction, which DDP then runs: each micro-step averaged; once a peer joined, the accumulated gradient is
    averaged again, so only the unpatched run is the reference)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Net(**net).double()
    ref = copy.deepcopy(model)
    plans = _plans(pattern, world)
    errors, none_ok = [], []

    def reference_step(it: int) -> list:
        active = [(plans[r][it][0], _batch(r, it, plans[r][it][1])) for r in range(world) if it < len(plans[r])]
        expected = [None if g is None else g * accum for g in _reference_grads(ref, active, world)]
        with torch.no_grad():
            for p, g in zip(ref.parameters(), expected):
                if g is not None:
                    p -= 0.1 * g
        return expected

    with ddp_patches.patched() if patched else contextlib.nullcontext():
        ddp = DDP(model, **(ddp_kwargs or {}))
        if comm_hook:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        if manual_finalize:
            ddp.require_manual_backward_finalization = True
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Join([ddp]) if pattern.startswith("join") else contextlib.nullcontext():
            for it, (loss_fn, flag) in enumerate(plans[rank]):
                x = _batch(rank, it, flag)
                for _ in range(accum - 1):
                    if no_sync_around == "both":
                        with ddp.no_sync():
                            loss_fn(ddp, x).backward()
                    elif no_sync_around == "forward":
                        with ddp.no_sync():
                            loss = loss_fn(ddp, x)
                        loss.backward()
                    else:
                        loss = loss_fn(ddp, x)
                        with ddp.no_sync():
                            loss.backward()
                loss_fn(ddp, x).backward()
                if manual_finalize:
                    ddp.finalize_backward()
                err, ok = _compare(model, reference_step(it))
                errors.append(err)
                none_ok.append(ok)
                opt.step()
                opt.zero_grad(set_to_none=True)
        # A rank that joined early got the final model from Join's post_hook: its reference catches up.
        for it in range(len(plans[rank]), max(len(p) for p in plans)):
            reference_step(it)
    final = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    from ddp_patches.rescue import edges as rescue

    edges = rescue.for_ddp(ddp)
    return {"errors": errors, "none_ok": none_ok, "final": final, "params": [p.detach() for p in model.parameters()],
            "fires_directly": edges is not None and edges._reducer_index is not None}


def _assert_matches_reference(results: list, tolerance: float = 1e-12) -> None:
    for r in results:
        assert max(r["errors"]) <= tolerance and all(r["none_ok"]) and r["final"] <= tolerance, r


# Each pattern trains without the library; with it, it must train the same (it hung before: the extra
# all-reduce was one collective more on the ranks that had data, or on the ranks that reached the outputs).
@pytest.mark.parametrize("pattern,net", [
    ("join", {"branch": False}),
    ("join", {"one_tensor": True}),
    ("off_output", {"branch": False}),
    ("off_output", {"branch": True}),
])
@pytest.mark.parametrize("patched", [False, True])
def test_patterns_that_work_without_the_library_work_with_it(pool, pattern, net, patched):
    _assert_matches_reference(pool.run(protocol_case, timeout=60, pattern=pattern, patched=patched, net=net))


@pytest.mark.parametrize("pattern", ["join", "off_output"])
@pytest.mark.parametrize("variant", ["no_sync", "comm_hook", "static_graph"])
@pytest.mark.parametrize("patched", [False, True])
def test_with_accumulation_comm_hooks_and_static_graph(pool, pattern, variant, patched):
    kwargs = {"no_sync": {"accum": 2}, "comm_hook": {"comm_hook": True},
              "static_graph": {"ddp_kwargs": {"static_graph": True}}}[variant]
    results = pool.run(protocol_case, timeout=60, pattern=pattern, patched=patched, net={"branch": False}, **kwargs)
    _assert_matches_reference(results, tolerance=2e-3 if variant == "comm_hook" else 1e-12)


@pytest.mark.parametrize("no_sync_around", ["forward", "backward"])
@pytest.mark.parametrize("patched", [False, True])
def test_join_with_no_sync_around_the_forward_or_the_backward_only(pool, no_sync_around, patched):
    """Whether a backward reduces is decided by its forward (found by review: deciding at the end of the backward
    made the ranks disagree under Join, a gloo size mismatch)."""
    results = pool.run(protocol_case, timeout=60, pattern="join", patched=patched, net={"branch": False}, accum=2,
                       no_sync_around=no_sync_around)
    if no_sync_around == "forward":
        _assert_matches_reference(results)
    elif patched:
        unpatched = pool.run(protocol_case, timeout=60, pattern="join", patched=False, net={"branch": False},
                             accum=2, no_sync_around=no_sync_around)
        for got, want in zip(results, unpatched):
            assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"])), (got, want)


@pytest.mark.parametrize("ddp_kwargs", [{}, {"static_graph": True}])
def test_join_with_a_branch_idle_on_some_ranks_matches_a_single_process(pool, ddp_kwargs):
    """Without the library this fails (the branch gets no gradient on rank 1); with it, Join's shadow and the
    reset agree: the branch's gradient is None from step 1 on, as in a single process. Without static graph the
    idle branch's hooks are fired by the reducer's own hook, directly (NOTE [Firing many hooks at once])."""
    results = pool.run(protocol_case, timeout=60, pattern="join_branch_idle", patched=True, net={"branch": True},
                       ddp_kwargs=ddp_kwargs)
    _assert_matches_reference(results)
    assert all(r["fires_directly"] for r in results) or ddp_kwargs


_HOST_READS = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__", "numpy")


def host_reads_case(branch_idle: bool) -> dict:
    """Count every conversion of a tensor to a Python value inside synced backwards (the library's per-step path
    runs there: the settle, the count-all-reduce), by wrapping torch.Tensor's conversions in this rank process.
    Autograd runs backward code outside any TorchFunctionMode, so a mode would not see them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    reads: list[str] = []
    counting = [False]
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counted(name):
        def read(self, *args, **kwargs):
            if counting[0]:
                reads.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    torch.manual_seed(0)
    model = _Net(branch=True).double()
    with ddp_patches.patched():
        ddp = DDP(model)
        for name in _HOST_READS:
            setattr(torch.Tensor, name, counted(name))
        try:
            for it in range(3):
                loss = _loss(ddp, _batch(rank, it, not branch_idle))
                counting[0] = True
                loss.backward()
                counting[0] = False
                model.zero_grad(set_to_none=True)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
    return {"reads": reads}


def test_the_reduced_counts_are_not_read_back_where_every_parameter_had_a_gradient(pool):
    for r in pool.run(host_reads_case, branch_idle=False):
        assert r["reads"] == [], r
    # Where a parameter had no gradient, this rank must learn whether any rank used it: one read per step.
    for r in pool.run(host_reads_case, branch_idle=True):
        assert r["reads"] == ["tolist"] * 3, r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the sync-debug mode counts device syncs")
def test_a_synced_step_adds_no_device_synchronisation_on_cuda():
    """One process group of one rank over NCCL would not be distributed; a gloo group over one GPU is: the
    library's per-step path must not synchronise the host with the device (torch.cuda.set_sync_debug_mode)."""
    import os

    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from tests.harness import _free_port

    port = _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_cuda_sync_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for r in results:
        assert r == "ok", r


def _cuda_sync_rank(rank: int, world: int, port: int, q) -> None:
    import os
    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = _Net(branch=False).cuda()
        with ddp_patches.patched():
            ddp = DDP(model)
            for it in range(5):
                x = _batch(rank, it, False).float().cuda()
                if it >= 2:  # after the bucket rebuild of the first iterations
                    torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    loss = _loss(ddp, x)
                    loss.backward()
                torch.cuda.set_sync_debug_mode("default")
                syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
                if it >= 2 and syncs:
                    q.put(f"rank {rank} step {it}: {syncs}")
                    return
                model.zero_grad(set_to_none=True)
        q.put("ok")
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(repr(e))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- torch 2.15's DDP options ------------------------------------------------------------------------
_TORCH_2_15 = pytest.mark.skipif(not hasattr(torch.nn.parallel.DistributedDataParallel, "finalize_backward"),
                                 reason="DDP's manual backward finalization and lazy bucket allocation: torch 2.15")


@_TORCH_2_15
@pytest.mark.parametrize("option", ["manual_finalize", "lazy_bucket_allocation"])
@pytest.mark.parametrize("patched", [False, True])
def test_torch_2_15_ddp_options_train_as_without_the_library(pool, option, patched):
    kwargs = {"manual_finalize": True} if option == "manual_finalize" else {"ddp_kwargs": {option: True}}
    _assert_matches_reference(pool.run(protocol_case, timeout=60, pattern="plain", patched=patched,
                                       net={"branch": False}, **kwargs))


@_TORCH_2_15
@pytest.mark.parametrize("option", ["manual_finalize", "lazy_bucket_allocation"])
def test_torch_2_15_ddp_options_with_a_parameter_no_rank_used(pool, option):
    """The branch is idle from step 1 on: fired without a gradient, then None again, after the user's
    finalize_backward() under manual finalization (NOTE [Manual finalization])."""
    kwargs = {"manual_finalize": True} if option == "manual_finalize" else {"ddp_kwargs": {option: True}}
    _assert_matches_reference(pool.run(protocol_case, timeout=60, pattern="branch_idle", patched=True,
                                       net={"branch": True}, **kwargs))
