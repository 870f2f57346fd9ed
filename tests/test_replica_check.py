"""The replica check (ddp_patches/guard/replica_check.py) under DDP communication hooks, on 2 gloo ranks fed different
data.

Post-local SGD (``post_localSGD_hook`` over per-rank subgroups + ``PostLocalSGDOptimizer`` with a
``PeriodicModelAverager`` or ``HierarchicalModelAverager``) keeps the replicas apart between averaging steps by
design: with the library it must train exactly as without it, with no "drifted apart" ERROR (and no
``ReplicaDivergenceError`` with on_unsynced="raise"), and the check says once, on rank 0, that it stepped aside. The
hooks that keep replicas equal (DDP's all-reduce, fp16 compress and its wrapper, PowerSGD) keep the check on: it
compares bit for bit at every step there, stays silent, and still catches a real drift
(NOTE [Replica check only where DDP promises equal replicas])."""

from __future__ import annotations

import contextlib

import pytest
import torch

import ddp_patches
from ddp_patches.guard import replica_check, unsynced as guard
from tests.test_guard import DIVERGED, _batch, _Capture, _in_sync, _mlp

ASIDE = "the replica check steps aside"
STEPS = 6


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


# -- rank functions ----------------------------------------------------------------------------------------------
def local_sgd(library: str | None, scheme: str = "periodic", steps: int = STEPS) -> dict:
    """Post-local SGD as torch documents it: global all-reduce for the first 2 backwards, then each rank alone (a
    subgroup of size 1 per rank); parameters averaged every 2 steps after 2 warm-up steps. ``library``: None
    (unpatched), or the guard's on_unsynced ("warn", "raise") with a replica check before every step. ``scheme``:
    "periodic", "hierarchical" (HierarchicalModelAverager), "noop-hook" (torch's debugging noop_hook, no gradient
    communication at all, + PeriodicModelAverager: a hook the library cannot vouch for), or "allreduce-subgroup"
    (torch's allreduce_hook handed the per-rank subgroup, + PeriodicModelAverager: local SGD by a vouched hook over
    a group that does not hold the DDP's ranks)."""
    from collections import OrderedDict

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, error, snapshots = dist.get_rank(), None, []
    subgroup, _ = dist.new_subgroups(group_size=1)  # collective: every rank, every run
    checked = ddp_patches.patched(on_unsynced=library, replica_check_every=1) if library else contextlib.nullcontext()
    with checked, _Capture() as cap:
        torch.manual_seed(0)
        ddp = DDP(_mlp())
        if scheme == "noop-hook":
            ddp.register_comm_hook(None, debugging_hooks.noop_hook)
        elif scheme == "allreduce-subgroup":
            ddp.register_comm_hook(subgroup, default_hooks.allreduce_hook)
        else:
            state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=2)
            ddp.register_comm_hook(state, post_localSGD_hook)
        if scheme == "hierarchical":  # each rank alone every 2 steps (a no-op here), both every 4
            averager = HierarchicalModelAverager(OrderedDict([(2, 1), (4, 2)]), warmup_steps=2)
        else:
            averager = PeriodicModelAverager(period=2, warmup_steps=2)
        opt = PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), averager)
        try:
            for it in range(steps):
                cap.step = it + 1
                ddp(_batch(rank, it)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                snapshots.append(_flat(ddp.module))
        except replica_check.ReplicaDivergenceError as exc:
            error = str(exc)
    return {"snapshots": snapshots, "all": cap.records, "error": error, "diverged": cap.lines(DIVERGED),
            "aside": cap.lines(ASIDE)}


def _register(ddp, hook: str):
    """Register one of the hooks the check vouches for; the PowerSGD state (or None)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "fp16-wrapper":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook))
    elif hook == "builtin-fp16":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    elif hook == "powerSGD":
        # Compression from the third backward on (the minimum with error feedback and warm start, both on)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    elif hook != "default+averager":
        raise ValueError(hook)
    return None


def vouched_hook(hook: str, on_unsynced: str = "raise", perturb_before: int | None = None) -> dict:
    """Train through the wrapper with ``hook`` and a replica check (bit for bit) before every step; with
    ``perturb_before``, rank 1 adds 1e-4 to one element of ``2.bias`` just before that step.
    "default+averager": no hook, a PostLocalSGDOptimizer + PeriodicModelAverager (the averager alone is no reason to
    step aside)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    with ddp_patches.patched(on_unsynced=on_unsynced, replica_check_every=1), _Capture() as cap:
        torch.manual_seed(0)
        ddp = DDP(_mlp())
        state = _register(ddp, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        if hook == "default+averager":
            opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=2, warmup_steps=1))
        for it in range(STEPS):
            cap.step = it + 1
            ddp(_batch(rank, it)).pow(2).mean().backward()
            if cap.step == perturb_before and rank == 1:
                with torch.no_grad():
                    ddp.module[2].bias[0] += 1e-4
            opt.step()
            opt.zero_grad()
        in_sync = _in_sync(ddp.module)
    compressed = state is not None and state.compression_stats()[2] < state.compression_stats()[1]
    return {"all": cap.records, "diverged": cap.lines(DIVERGED), "in_sync": in_sync, "compressed": compressed}


# -- tests: post-local SGD -------------------------------------------------------------------------------------
def _drift_steps(rank0: dict, rank1: dict) -> list[int]:
    """The steps after which the two ranks' parameters differed."""
    return [i + 1 for i, (a, b) in enumerate(zip(rank0["snapshots"], rank1["snapshots"])) if not torch.equal(a, b)]


@pytest.mark.parametrize("scheme", ["periodic", "hierarchical", "noop-hook", "allreduce-subgroup"])
@pytest.mark.parametrize("library", ["warn", "raise"])
def test_local_sgd_trains_as_without_the_library_and_the_check_steps_aside(pool, scheme, library):
    unpatched = pool.run(local_sgd, library=None, scheme=scheme, timeout=60)
    # Local SGD is at work: the replicas differ after some steps, by design (and agree after an averaging step)
    drift = _drift_steps(*unpatched)
    assert drift and drift != list(range(1, STEPS + 1)), drift
    patched = pool.run(local_sgd, library=library, scheme=scheme, timeout=60)
    for rank, (before, after) in enumerate(zip(unpatched, patched)):
        assert after["error"] is None and after["diverged"] == [], after["all"]  # no false alarm, no crash
        assert len(after["snapshots"]) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(before["snapshots"], after["snapshots"]))  # bit-equal, each step
        assert before["all"] == []
    rank0, rank1 = patched
    assert rank1["all"] == [] and len(rank0["all"]) == 1, (rank0["all"], rank1["all"])  # one line, on rank 0
    step, level, message = rank0["aside"][0]
    assert step == 1 and level == "WARNING" and "DistributedDataParallel(Sequential)" in message
    hook = {"noop-hook": "noop_hook", "allreduce-subgroup": "allreduce_hook"}.get(scheme, "post_localSGD_hook")
    assert hook in message and "unsynchronised-gradient guard stays on" in message


# -- tests: the hooks that keep the replicas equal keep the check ------------------------------------------------
@pytest.mark.parametrize("hook", ["default+averager", "fp16", "fp16-wrapper", "builtin-fp16", "powerSGD"])
def test_hooks_that_keep_replicas_equal_keep_the_check_and_it_stays_silent(pool, hook):
    """A check before every step compares the fingerprints bit for bit: silence means bit-equal replicas at every
    step (for PowerSGD: measured, with compression and error feedback on from the third step)."""
    for r in pool.run(vouched_hook, hook=hook, timeout=60):
        assert r["all"] == [] and r["in_sync"], r["all"]
        assert r["compressed"] == (hook == "powerSGD")


@pytest.mark.parametrize("hook", ["powerSGD", "fp16-wrapper"])
def test_a_real_drift_under_a_vouched_hook_is_still_caught(pool, hook):
    rank0, rank1 = pool.run(vouched_hook, hook=hook, on_unsynced="warn", perturb_before=4, timeout=60)
    # At once, on the rank that compared (the later of the two at that step), and once on each rank that compares
    # (NOTE [One ERROR per drift]): the drift lasts, so later checks on that rank say nothing more.
    assert sorted(rank0["diverged"] + rank1["diverged"])[0][0] == 4, (rank0["all"], rank1["all"])
    assert len(rank0["diverged"]) <= 1 and len(rank1["diverged"]) <= 1, (rank0["all"], rank1["all"])
    step, level, message = sorted(rank0["diverged"] + rank1["diverged"])[0]
    assert level == "ERROR" and "'2.bias'" in message and not rank1["in_sync"]
    assert not any(ASIDE in m for _, _, m in rank1["all"] + rank0["all"])


# -- uneven inputs under torch's Join: the store waits have a partner that will come, or are not made ----------------
def join_uneven(library: bool, batches: tuple[int, ...] = (1, 3), every: int | None = None, after: int = 0,
                perturb_after: int | None = None, through_module: bool = False, timeout_s: float = 5.0) -> dict:
    """``with Join([ddp])`` over uneven inputs (rank r has ``batches[r]``), then ``after`` steps in step on every
    rank; with ``perturb_after``, rank 1 adds 1e-4 to one element of ``2.bias`` before that step after the Join.
    ``through_module``: the loss inside the Join goes through ``ddp.module`` (no DDP collective at all).
    ``library``: apply() with ``replica_check_every=every`` (None: the default), or nothing at all. How long it
    took, what the library logged, and whether the ranks ended in sync."""
    import time

    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join

    rank = dist.get_rank()
    options = {} if every is None else {"replica_check_every": every}
    old, replica_check.REPLICA_CHECK_TIMEOUT_S = replica_check.REPLICA_CHECK_TIMEOUT_S, timeout_s
    try:
        with (ddp_patches.patched(**options) if library else contextlib.nullcontext()), _Capture() as cap:
            torch.manual_seed(0)
            ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            start = time.perf_counter()
            with Join([ddp]):
                for it in range(batches[rank]):
                    cap.step = it + 1
                    (ddp.module if through_module else ddp)(_batch(rank, it)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
            joined_in_sync = _in_sync(ddp.module)  # DDP's join hook broadcast the last joiner's parameters
            for it in range(after):
                cap.step = 100 + it + 1  # 101, 102, ...: the steps after the Join
                ddp(_batch(rank, 10 + it)).pow(2).mean().backward()
                if it + 1 == perturb_after and rank == 1:
                    with torch.no_grad():
                        ddp.module[2].bias[0] += 1e-4
                opt.step()
                opt.zero_grad()
            elapsed = time.perf_counter() - start
            in_sync = _in_sync(ddp.module)
    finally:
        replica_check.REPLICA_CHECK_TIMEOUT_S = old
    return {"elapsed": elapsed, "all": cap.records, "diverged": cap.lines(DIVERGED), "in_sync": in_sync,
            "joined_in_sync": joined_in_sync, "unsynced": cap.lines("never averaged")}


def test_join_with_uneven_inputs_trains_as_without_the_library_with_no_wait(pool):
    """torch's Join: rank 0 runs out of data after one step and shadows rank 1's collectives, so it never reaches the
    check before rank 1's step 2. Unpatched: trains, in sync, about 0.1 s on 2 CPU ranks. Patched, before the
    store waits had a rule: rank 1 waited for rank 0's fingerprint until the timeout (5 s here, 60 s by default)."""
    unpatched = pool.run(join_uneven, library=False, timeout=60)
    assert all(r["in_sync"] and r["all"] == [] for r in unpatched)
    assert max(r["elapsed"] for r in unpatched) < 2.0, unpatched
    patched = pool.run(join_uneven, library=True, timeout=60)
    for r in patched:
        assert r["in_sync"] and r["all"] == [], r["all"]
        assert r["elapsed"] < 2.0, [p["elapsed"] for p in patched]  # well under the 5 s timeout: no wait


def test_join_then_steps_in_step_are_checked_again_and_a_drift_is_caught(pool):
    """A check before every step, uneven inputs under Join (rank 0: 2 steps, rank 1: 5), then 3 steps in step: the
    ranks' step counts now differ by 3. No wait, no false alarm (the counts start over after the Join), and a
    parameter changed on rank 1 after the Join is reported at that step. Unpatched: trains, about 0.1 s, and the
    changed parameter goes unnoticed."""
    kwargs = {"batches": (2, 5), "after": 3, "perturb_after": 2}
    unpatched = pool.run(join_uneven, library=False, **kwargs, timeout=60)
    assert all(r["joined_in_sync"] and not r["in_sync"] and r["all"] == [] for r in unpatched)
    rank0, rank1 = pool.run(join_uneven, library=True, every=1, **kwargs, timeout=60)
    assert rank0["joined_in_sync"] and rank1["joined_in_sync"]
    both = rank0["all"] + rank1["all"]  # reported by the rank that compared: the later of the two at that step
    assert min(s for s, _, _ in both) == 102 and both == rank0["diverged"] + rank1["diverged"], both
    assert len(rank0["all"]) <= 1 and len(rank1["all"]) <= 1, both  # once per rank: NOTE [One ERROR per drift]
    assert {level for _, level, _ in both} == {"ERROR"}, both
    assert max(rank0["elapsed"], rank1["elapsed"]) < 2.0, (rank0["elapsed"], rank1["elapsed"])


def test_join_with_a_loss_through_module_waits_for_nothing(pool):
    """Under Join with the loss through ``.module`` nothing ties the ranks' steps together (no DDP collective), and a
    rank out of data may be gone at any time: inside a Join such a step compares only what is already there. The
    guard still warns at the first step, on both ranks. Unpatched: trains (drifting), about 0.01 s; before the rule,
    rank 1 waited for rank 0's fingerprint before its step 2 until the timeout."""
    unpatched = pool.run(join_uneven, library=False, through_module=True, timeout=60)
    assert all(r["all"] == [] and r["elapsed"] < 2.0 for r in unpatched), unpatched
    for r in pool.run(join_uneven, library=True, every=1, through_module=True, timeout=60):
        assert [s for s, _, _ in r["unsynced"]] == [1] and r["all"] == r["unsynced"], r["all"]
        assert r["elapsed"] < 2.0, r["elapsed"]


def test_a_fingerprint_of_no_tensor_is_empty_not_an_error():
    """A step where none of a DDP's parameters has a gradient (all of them substituted by ``functional_call``, or
    zeroed after the backward) fingerprints nothing: before, ``torch.stack`` of no tensor raised in the optimizer
    step's pre-hook."""
    from ddp_patches.guard.replica_check import fingerprint

    assert fingerprint([]).numel() == 0
    assert fingerprint([torch.ones(2)]).tolist() == [2.0, 2.0 ** 0.5]


def two_optimizers(library: bool, every: int = 2, steps: int = 16, perturb_at: int = 5) -> dict:
    """One DDP, two optimizers (one per layer), each stepping every iteration; rank 1 changes a weight after
    iteration ``perturb_at``, and rank 0 is the slower writer (a 5 ms pause after its backward, as logging)."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    with (ddp_patches.patched(replica_check_every=every) if library else contextlib.nullcontext()), _Capture() as cap:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
        optimizers = [torch.optim.SGD(ddp.module[0].parameters(), lr=0.01),
                      torch.optim.SGD(ddp.module[2].parameters(), lr=0.01)]
        for it in range(steps):
            cap.step = it + 1
            ddp(_batch(rank, it)).pow(2).mean().backward()
            if rank == 0:
                time.sleep(0.005)
            if it == perturb_at and rank == 1:
                with torch.no_grad():
                    ddp.module[0].weight[0, 0] += 0.5
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    return {"diverged": cap.lines(DIVERGED), "in_sync": _in_sync(ddp.module)}


def test_two_optimizers_on_one_ddp_still_catch_a_drift(pool):
    """Two optimizers step one DDP each iteration, so a check may fall on either's step. Before, only the first
    optimizer's step could wait for rank 0's record, so with an even interval every check fell on a step that only
    peeked, and a drift behind a slower rank 0 was never reported (found by review). Now rank 0, the later one,
    compares. Unpatched: trains and drifts silently."""
    assert not any(r["in_sync"] or r["diverged"] for r in pool.run(two_optimizers, library=False, timeout=60))
    rank0, rank1 = pool.run(two_optimizers, library=True, timeout=60)
    first = sorted(rank0["diverged"] + rank1["diverged"])
    assert first and first[0][0] == 6, first  # at the iteration of the change


# -- one rank skips an optimizer step the others take: no wait, and the drift is reported ----------------------------
@pytest.fixture(scope="module")
def pool3():
    from tests.harness import DistPool

    p = DistPool(world_size=3)
    yield p
    p.close()


def rank0_skips_a_step(iters: int = 6, skip_at: int = 3) -> dict:
    """Every iteration runs a synchronised forward and backward on every rank and a replica check before every
    step; at iteration ``skip_at`` rank 0 alone skips its optimizer step (an AMP GradScaler that found inf only
    there, or ``if rank == 0 and cond: continue``): from then on its parameters lag its peers' by one update. How
    long the loop took, what the library logged (with the iteration), and whether the ranks ended in sync."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    with ddp_patches.patched(replica_check_every=1), _Capture() as cap:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        start = time.perf_counter()
        for it in range(1, iters + 1):
            cap.step = it
            ddp(_batch(rank, it)).pow(2).mean().backward()
            if not (rank == 0 and it == skip_at):
                opt.step()
            opt.zero_grad()
        elapsed = time.perf_counter() - start
        in_sync = _in_sync(ddp.module)
    return {"elapsed": elapsed, "all": cap.records, "diverged": cap.lines(DIVERGED), "in_sync": in_sync}


@pytest.mark.parametrize("world", [2, 3])
def test_rank0_skipping_a_step_stalls_nothing_and_the_drift_is_reported(pool, pool3, world):
    """Before the check stopped waiting: every other rank waited for rank 0's fingerprint before its step 3 until
    the timeout (60 s measured on 2 ranks; rank 0 meanwhile blocked in the next all-reduce), said so, and compared
    nothing more, so the drift went unreported. Now no rank waits, and the drift is reported by rank 0, the one that
    reaches each step count last: its step 4 (iteration 5) is the first whose parameters differ from the others'
    step 4 (rank 0 applied the updates of iterations 1, 2, 4; the others those of 1, 2, 3)."""
    results = (pool if world == 2 else pool3).run(rank0_skips_a_step, timeout=120)
    assert max(r["elapsed"] for r in results) < 5.0, [r["elapsed"] for r in results]
    assert not any(r["in_sync"] for r in results)
    rank0 = results[0]
    # One ERROR for the drift (NOTE [One ERROR per drift]): it used to repeat at every later check (iteration 6).
    assert [(it, level) for it, level, _ in rank0["all"]] == [(5, "ERROR")], rank0["all"]
    message = rank0["diverged"][0][2]
    assert "rank 0:" in message and "from rank 1's" in message and "optimizer step 4 " in message
    assert ("rank(s) 2" in message) == (world == 3)
    for r in results[1:]:  # each checked its steps before rank 0 did: nothing of rank 0's to compare yet, no wait
        assert r["all"] == [], r["all"]


def drift_then_reload_then_drift(iters: int = 8) -> dict:
    """Rank 1 edits its parameters alone after the steps of iterations 2 and 6 (a per-rank load, say); after the step
    of iteration 4 every rank takes rank 0's parameters again (``dist.broadcast``). Rank 1 sleeps before each step,
    so it is the rank that finds the other's fingerprint and compares. What each rank logged, by iteration."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    with ddp_patches.patched(replica_check_every=1), _Capture() as cap:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for it in range(1, iters + 1):
            cap.step = it
            ddp(_batch(rank, it)).pow(2).mean().backward()
            if rank == 1:
                time.sleep(0.3)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                if rank == 1 and it in (2, 6):
                    for p in ddp.module.parameters():
                        p.add_(1e-3)
                if it == 4:
                    for p in ddp.module.parameters():
                        dist.broadcast(p, 0)
    return {"all": [(it, level) for it, level, _ in cap.records]}


def test_a_drift_is_reported_once_and_its_end_too(pool):
    """A drift used to log the same ERROR at every later check (here iterations 3, 4, 7 and 8): now one ERROR where it
    is first seen, one WARNING when the replicas agree again, and a new ERROR for a new drift."""
    rank0, rank1 = pool.run(drift_then_reload_then_drift, timeout=120)
    assert rank0["all"] == [], rank0
    assert rank1["all"] == [(3, "ERROR"), (5, "WARNING"), (7, "ERROR")], rank1


def three_ranks_one_apart(steps: int = 4) -> dict:
    """Rank 1 edits a weight after step 1 and stays apart. Sleeps before each step decide which partners' records
    rank 0 finds when it checks: at step 3 only rank 2's (which agrees), at steps 2 and 4 rank 1's too."""
    import time

    import torch.distributed as dist

    delays = {2: {0: 0.6, 2: 0.3}, 3: {0: 0.6, 1: 1.8}, 4: {0: 0.6, 2: 0.3}}
    rank = dist.get_rank()
    with ddp_patches.patched(replica_check_every=1), _Capture() as cap:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for it in range(1, steps + 1):
            cap.step = it
            ddp(_batch(0, it)).pow(2).mean().backward()
            time.sleep(delays.get(it, {}).get(rank, 0.0))
            opt.step()
            opt.zero_grad()
            if it == 1 and rank == 1:
                with torch.no_grad():
                    ddp.module[0].weight[0, 0] += 1.0
    return {"all": [(it, level) for it, level, _ in cap.records]}


def test_three_ranks_one_apart_no_false_all_clear(pool3):
    """Found by review: with a flag per DDP, rank 0 said "agree again" at step 3 (only rank 2's record there, which
    agrees) while rank 1 was still apart, then reported the same drift again at step 4. Per partner: one ERROR."""
    rank0 = pool3.run(three_ranks_one_apart, timeout=120)[0]
    assert rank0["all"] == [(2, "ERROR")], rank0
