"""What offload assumes about torch.utils.checkpoint's internals, probed at install (NOTE [Probed assumptions]):
``ASSUMPTIONS``, and ``generator_name()``, the generator offload wraps (NOTE [Which generator checkpoint() calls]).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as torch_checkpoint

from .._registry import REGISTRY
from ..probes import Assumption, AssumptionFailed, expect, has

# Newest first: the first one checkpoint() is seen to call is the one offload wraps.
GENERATOR_NAMES = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")

_found: dict[str, str] = {}


def generator_name() -> str:
    """The module global of torch.utils.checkpoint that checkpoint(use_reentrant=False) calls (probed once)."""
    if "name" not in _found:
        _found["name"] = _probe_generator_name()
    return _found["name"]


def forget() -> None:
    """Probe the generator's name afresh at the next apply() (NOTE [Each module forgets its own state])."""
    _found.clear()


REGISTRY.on_reset(forget)


def _check_generator_global() -> None:
    _found["name"] = _probe_generator_name()  # probed afresh at each apply(), never from an older answer


# NOTE [Which generator checkpoint() calls]
# Invariant: offload wraps the generator a non-reentrant ``checkpoint()`` really runs, a module global of
# torch.utils.checkpoint looked up at call time (NOTE [What the outer hook sees]): up to torch 2.13
# ``_checkpoint_without_reentrant_generator(fn, preserve, context_fn, ..., *args, **kwargs)``; from 2.14
# ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, ...)``, with the old name kept as a shim
# nobody in torch calls, so a wrapper of the wrong name is never reached and offload moves nothing.
# Rule: the name is observed, not read from a version table: each candidate present in the module is swapped for a
# spy, one tiny checkpoint runs, and the first candidate the spy saw is the target. The wrapper passes ``fn`` first
# and everything else through untouched, which fits both signatures.
# Test: tests/test_probes.py::test_offload_follows_the_generator_checkpoint_calls
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
def _probe_generator_name() -> str:
    present = [n for n in GENERATOR_NAMES if callable(vars(torch_checkpoint).get(n))]
    for name in present:
        original = vars(torch_checkpoint)[name]
        calls = []

        def spy(fn, *args, _original=original, **kwargs):
            calls.append(fn)
            return (yield from _original(fn, *args, **kwargs))

        with _swapped(name, spy):
            _tiny_checkpoint()
        if calls:
            return name
    raise AssumptionFailed(f"checkpoint(use_reentrant=False) called none of {', '.join(present) or 'no candidate'} "
                           f"(known names: {', '.join(GENERATOR_NAMES)})")


def _tiny_checkpoint(fn=None):
    x = torch.ones(3, dtype=torch.float32, requires_grad=True)
    w = torch.full((3,), 0.5, dtype=torch.float32, requires_grad=True)
    fn = fn or (lambda t: (t * w).sin())
    out = torch_checkpoint.checkpoint(fn, x, use_reentrant=False)
    out.sum().backward()
    return x, w


class _swapped:
    """Put ``replacement`` in the module global ``name`` for the length of a with-block (probes only)."""

    def __init__(self, name: str, replacement) -> None:
        self.name, self.replacement = name, replacement

    def __enter__(self) -> None:
        self.original = vars(torch_checkpoint)[self.name]
        setattr(torch_checkpoint, self.name, self.replacement)

    def __exit__(self, *exc) -> None:
        setattr(torch_checkpoint, self.name, self.original)


def _check_hook_stack() -> None:
    has(torch._C._autograd, "_top_saved_tensors_default_hooks", "_saved_tensors_hooks_is_enabled")
    has(torch._C, "_current_graph_task_id")
    expect(torch._C._autograd._top_saved_tensors_default_hooks(False) is None
           and torch._C._autograd._saved_tensors_hooks_is_enabled() is True,
           "the hook stack does not read empty and enabled outside any hook")


def _check_outer_hook_sees_inputs() -> None:
    """Hooks pushed around the generator see exactly the checkpoint's input once in forward, none during the
    recompute, and unpack returns it for a gradient equal to an uncheckpointed one."""
    name = generator_name()
    original = vars(torch_checkpoint)[name]
    packed, in_backward, unpacked = [], [], []

    def pack(t):
        (in_backward if torch._C._current_graph_task_id() != -1 else packed).append(t)
        return t

    def unpack(t):
        unpacked.append(t)
        return t

    def generator(fn, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return (yield from original(fn, *args, **kwargs))

    with _swapped(name, generator):
        x, w = _tiny_checkpoint()
    expect(len(packed) == 1 and packed[0].data_ptr() == x.data_ptr() and packed[0].shape == x.shape,
           f"the outer hook packed {len(packed)} tensor(s) in forward, expected the checkpoint's one input")
    expect(not in_backward, f"the outer hook packed {len(in_backward)} tensor(s) during the recompute")
    expect(len(unpacked) == 1, f"the outer hook unpacked {len(unpacked)} tensor(s), expected 1")
    expect(torch.allclose(x.grad, (x * w).cos() * w) and torch.allclose(w.grad, (x * w).cos() * x),
           "the checkpointed gradient differs from the direct one")


ASSUMPTIONS = (
    Assumption("hook-stack", "torch._C._autograd exposes the saved-tensor hook stack (_top_saved_tensors_default_"
               "hooks, _saved_tensors_hooks_is_enabled) and torch._C._current_graph_task_id", _check_hook_stack),
    Assumption("generator-global", "checkpoint(use_reentrant=False) runs a generator it looks up as a module global "
               "of torch.utils.checkpoint (NOTE [Which generator checkpoint() calls])", _check_generator_global),
    Assumption("outer-hook", "saved-tensor hooks pushed around that generator see exactly the checkpoint's inputs "
               "and nothing during the recompute (NOTE [What the outer hook sees])", _check_outer_hook_sees_inputs),
)
