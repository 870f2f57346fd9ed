"""DDP construction: the find_unused choice, the trainable-set guard and the static-graph first step."""

from __future__ import annotations

import pytest
import torch

import ddp_patches
from ddp_patches.reducer import choose_ddp_settings


@pytest.mark.parametrize("explicit,swap,expected_changes", [
    ({}, True, {"find_unused_parameters": True}),
    ({"find_unused_parameters": False}, True, {}),
    ({"find_unused_parameters": True}, True, {}),
    ({"static_graph": True}, True, {}),
    ({}, False, {}),  # without the checkpoint swap, True would break reentrant regions
])
def test_find_unused_choice(explicit, swap, expected_changes):
    changes, reasons = choose_ddp_settings(explicit, checkpoint_swap=swap)
    assert changes == expected_changes
    assert bool(reasons) == (bool(changes) or explicit.get("find_unused_parameters") is False)


def built_settings(ddp_kwargs: dict, checkpointing: bool = True) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    with ddp_patches.patched(checkpointing=checkpointing):
        ddp = DDP(torch.nn.Linear(4, 4), **ddp_kwargs)
    return {"find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph}


@pytest.mark.parametrize("ddp_kwargs,checkpointing,find_unused", [
    ({}, True, True),
    ({"find_unused_parameters": False}, True, False),
    ({}, False, False),
])
def test_settings_applied_at_construction(pool, ddp_kwargs, checkpointing, find_unused):
    for r in pool.run(built_settings, ddp_kwargs=ddp_kwargs, checkpointing=checkpointing):
        assert r["find_unused_parameters"] is find_unused


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
