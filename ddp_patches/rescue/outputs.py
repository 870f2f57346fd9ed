"""Tensors found in a module's output as DDP finds them, and replaced in place: ``map_tensors`` (the rescue's start
nodes; the tiled MLP and the other patches borrow it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree


def _is_graph_output(t: Any) -> bool:
    # Not a leaf: a parameter returned as an output stays itself (its own hook fires), not a detached alias.
    return isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None


# NOTE [Outputs found as DDP finds them]
# DDP's ``_find_tensors`` looks into tensors, lists, tuples, dicts and dataclasses; pytree alone sees a plain
# @dataclass as one leaf without tensors. So pytree takes what it knows (tuples, namedtuples, dicts, transformers'
# ModelOutput), and a dataclass leaf is looked into field by field (in place: its fields are what the caller
# reads; a frozen one too).
# Test: tests/test_reach.py::test_dataclass_outputs_are_rescued.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
def map_tensors(output: Any, select: Callable[[Any], bool], apply: Callable[[list], tuple]) -> Any:
    """Replace the tensors ``select`` picks in ``output`` with ``apply(all of them)``'s results, in order."""
    slots: list[tuple[Any, ...]] = []  # ("leaf", index) or ("field", obj, name)
    leaves, spec = pytree.tree_flatten(output)
    for i, leaf in enumerate(leaves):
        if select(leaf):
            slots.append(("leaf", i))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            _dataclass_slots(leaf, select, slots, depth=0)
    if not slots:
        return None
    found = [leaves[s[1]] if s[0] == "leaf" else getattr(s[1], s[2]) for s in slots]
    for slot, new in zip(slots, apply(found)):
        if slot[0] == "leaf":
            leaves[slot[1]] = new
        else:
            object.__setattr__(slot[1], slot[2], new)
    return pytree.tree_unflatten(leaves, spec)


def _dataclass_slots(obj: Any, select, slots: list, depth: int) -> None:
    if depth > 8:
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, None)
        if select(value):
            slots.append(("field", obj, f.name))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            _dataclass_slots(value, select, slots, depth + 1)
