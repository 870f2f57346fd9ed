"""DDP construction: the find_unused choice, the trainable-set guard and the static-graph first step."""

from __future__ import annotations

import pytest
import torch

import ddp_patches


def released_case() -> dict:
    """destroy_process_group() with a DDP still alive (what trainer.end() does): its reducer goes first."""
    import datetime
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches.teardown import ReleasedReducer

    with ddp_patches.patched():
        # A group of our own, so that the pool's default group survives the test.
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
        ddp = DDP(torch.nn.Linear(4, 4), process_group=group)
        ddp(torch.randn(2, 4)).sum().backward()
        dist.destroy_process_group(group)
        released = isinstance(ddp.reducer, ReleasedReducer) and ddp.process_group is None
        with torch.no_grad():
            ddp(torch.randn(2, 4))  # evaluation needs no reducer
        try:
            ddp(torch.randn(2, 4))
            message = "no error"
        except RuntimeError as e:
            message = str(e)
    return {"released": released, "message": message, "state_dict": sorted(ddp.module.state_dict()),
            "pid": os.getpid()}


def test_destroying_the_group_releases_the_reducer_first(pool):
    for r in pool.run(released_case):
        assert r["released"]
        assert "process group was destroyed" in r["message"] and "new DistributedDataParallel" in r["message"]
        assert r["state_dict"] == ["bias", "weight"]


def trainable_changed_case(change: str) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    with ddp_patches.patched():
        ddp = DDP(model)
        ddp(torch.randn(2, 4)).sum().backward()
        if change == "unfreeze":
            model[0].weight.requires_grad_(True)
        else:
            model[1].bias.requires_grad_(False)
        try:
            ddp(torch.randn(2, 4))
        except ddp_patches.TrainableParametersChangedError as e:
            return str(e)
        finally:
            with torch.no_grad():  # evaluation is never blocked by the guard
                ddp(torch.randn(2, 4))
    return "no error"


@pytest.mark.parametrize("change,names", [("unfreeze", "0.weight"), ("freeze", "1.bias")])
def test_trainable_set_change_is_a_clear_error(pool, change, names):
    for message in pool.run(trainable_changed_case, change=change):
        assert "changed after the model was wrapped" in message
        assert names in message
        assert "before wrapping" in message


def no_sync_case(static_graph: bool) -> list[bool]:
    """Whether gradient sync was really disabled inside no_sync(), for the first three iterations."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    seen = []
    with ddp_patches.patched():
        ddp = DDP(torch.nn.Linear(4, 4), static_graph=static_graph)
        for _ in range(3):
            with ddp.no_sync():
                seen.append(ddp.require_backward_grad_sync)
                ddp(torch.randn(2, 4)).sum().backward()
            ddp(torch.randn(2, 4)).sum().backward()
    return seen


def test_no_sync_is_synced_only_for_the_first_static_graph_backward(pool):
    assert pool.run(no_sync_case, static_graph=True)[0] == [True, False, False]
    assert pool.run(no_sync_case, static_graph=False)[0] == [False, False, False]
