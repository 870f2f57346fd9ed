"""Raw DDP + activation checkpointing, 2 gloo ranks with different data, parity with a full-batch replica.

Under pytest the scenarios run in the shared 2-rank pool (tests/harness.py). Run directly,
``torchrun --nproc_per_node=2 tests/test_raw_ddp_parity.py`` runs the same scenarios in the
launched ranks; with one process the DDP part is skipped and the no-op guarantee is checked instead.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

if __name__ == "__main__":  # run as a script by torchrun: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ddp_patches
from ddp_patches.verify.raw_models import RAW_MODULES, raw_batch, raw_loss
from tests._helpers import library

TOL = 1e-9
MODULES = ["once", "twice", "weight_sharing", "dynamic", "no_grad_input", "unused_on_some_ranks", "hidden_reentrant"]
FIND_UNUSED = [True, False, None]  # None: not passed (DDP's default, which the library keeps)


def unsupported(module: str, find_unused, static_graph: bool) -> str | None:
    """Combinations no DDP setting can train, with or without this library."""
    if module == "hidden_reentrant" and find_unused is True and not static_graph:
        return ("a home-made reentrant Function hides its parameters from DDP's search for unused ones "
                "(fails the same way unpatched; no patch of torch.utils.checkpoint reaches it)")
    return None


MATRIX = [
    pytest.param(*case, id="-".join(map(str, case)))
    for case in itertools.product(MODULES, [True, False], FIND_UNUSED, [False, True], [False, True], [1, 2])
    if unsupported(case[0], case[2], case[3]) is None
]


def raw_case(module, use_reentrant, find_unused, static_graph, bucket_view, accum, patched=True) -> dict:
    """One scenario on one rank: returns the parity result as a dict."""
    from ddp_patches.verify.raw_models import raw_parity

    kwargs = {"static_graph": static_graph, "gradient_as_bucket_view": bucket_view}
    if find_unused is not None:
        kwargs["find_unused_parameters"] = find_unused
    with library(patched):
        return raw_parity(module, use_reentrant=use_reentrant, ddp_kwargs=kwargs, accum=accum).as_dict()


@pytest.mark.slow
@pytest.mark.parametrize("module,use_reentrant,find_unused,static_graph,bucket_view,accum", MATRIX)
def test_raw_ddp_checkpoint_matrix(pool, module, use_reentrant, find_unused, static_graph, bucket_view, accum):
    results = pool.run(
        raw_case,
        module=module,
        use_reentrant=use_reentrant,
        find_unused=find_unused,
        static_graph=static_graph,
        bucket_view=bucket_view,
        accum=accum,
    )
    for rank, r in enumerate(results):
        assert r["iterations"] == 3
        assert r["max_rel_error"] <= TOL, f"rank {rank}: gradient error {r['max_rel_error']:.2e}"
        assert r["ranks_in_sync"]


# The scenarios above would fail without the library; these show it for one case of each failure, so a
# passing matrix cannot be a matrix that never exercised the bug.
@pytest.mark.parametrize(
    "case,expected",
    [
        (("twice", True, False, False, False, 1), "marked as ready twice"),
        (("once", True, True, False, False, 1), "marked as ready twice"),
        (("once", False, False, True, False, 2), "expect_autograd_hooks_"),
        (("unused_on_some_ranks", False, None, False, False, 1), "finished reduction in the prior iteration"),
        (("dynamic", False, None, True, False, 1), "static_graph|wrong gradient"),
    ],
    ids=["reentrant-twice", "reentrant-find-unused", "static-graph-accumulation", "unused-on-one-rank",
         "dynamic-static-graph"],
)
@pytest.mark.slow
def test_unpatched_baseline_fails(pool, case, expected):
    from tests.harness import RankError

    with pytest.raises(RankError, match=expected):
        pool.run(raw_case, **dict(zip(
            ["module", "use_reentrant", "find_unused", "static_graph", "bucket_view", "accum"], case)), patched=False)


def test_single_process_is_bit_identical():
    """No process group: apply() must not change a single bit of the loss or the gradients."""
    assert not ddp_patches.is_distributed()
    results = []
    for patched in (False, True):
        torch.manual_seed(0)
        model = RAW_MODULES["twice"](use_reentrant=True).double()
        with library(patched):
            loss = raw_loss(model, raw_batch(0, 0, 0))
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def main() -> int:
    """Entry point under torchrun: every matrix scenario in these ranks; prints 'N passed, N failed'."""
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        test_single_process_is_bit_identical()
        print("single process: DDP scenarios skipped; no-op check passed")
        print("1 passed, 0 failed")
        return 0
    dist.init_process_group("gloo")
    passed = failed = 0
    try:
        for param in MATRIX:
            r = raw_case(*param.values)
            ok = r["max_rel_error"] <= TOL and r["ranks_in_sync"]
            passed, failed = passed + ok, failed + (not ok)
            if dist.get_rank() == 0 and not ok:
                print("FAILED", param.id, r)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
