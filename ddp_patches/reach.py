"""Mechanism 2b: a trainable parameter that no module used in a forward still gets its DDP hook, once.

# NOTE [Unused parameters without find_unused_parameters]
# DDP's reducer expects one AccumulateGrad hook per trainable parameter per synced backward. A parameter that
# the forward never touched (LoRA on a vision tower and a text-only batch, an idle expert, a branch not taken)
# gets none: with find_unused_parameters=False the reducer raises "Expected to have finished reduction in the
# prior iteration" (gloo) or hangs (NCCL), and static_graph=True rejects a graph that changes. The usual cure,
# find_unused_parameters=True, costs on every step (a graph search, an all-reduce of the used-parameter map,
# no bucket rebuild, a clone of every output) and breaks patterns that work without it: accelerate's
# ``trigger_sync_in_backward`` calls ``prepare_for_backward([])``, which then marks every parameter unused
# before its real hook marks it again ("marked as ready twice"), and PowerSGD's hook falls out of step.
#
# So the DDP setting is left as the user (or the Trainer) chose it, and the forward is made to satisfy it:
# after the wrapped module's forward, every trainable parameter that the outputs cannot reach through the autograd
# graph -- its module did not run (a vision tower on a text-only rank, an idle expert), or ran and fed nothing
# (the last CLIP layer of Llava, which takes its image features from layer -2) -- gets one edge from the outputs
# into its AccumulateGrad node, through ``_ZeroGradEdges``, whose backward returns None for it. Autograd still
# runs that AccumulateGrad node (with an undefined gradient it leaves ``.grad`` alone) and then its post-hooks,
# where DDP's reducer marks the parameter ready with a zero bucket slot -- the case reducer.cpp documents as
# "hooks can be fired with undefined grads". The average over ranks is then exactly what
# find_unused_parameters=True gives; nothing is allocated; the outputs are aliases (``detach()``), not copies,
# so in-place edits of them (``logits.div_(temperature)``) keep working. The walk over the graph is in Python:
# about 3 ms per forward for a 32-layer LoRA model (4,654 nodes), against DDP's own search in C++ plus an
# all-reduce.
#
# One exception, on purpose: a parameter whose module ran under no_grad in this forward gets no edge. That is
# how a reentrant region looks from outside (a custom autograd.Function that recomputes under no_grad and calls
# backward in its own backward): its parameters are unreachable from the outputs yet fire their hooks later, in
# a nested graph task, and an extra edge would make that a second mark. Such code keeps working as it does
# without the library; the price is that a parameter used only under no_grad is not rescued.
#
# The difference from find_unused_parameters=True, stated in DDP_GRADIENT_CHECKPOINTING_FIX.md: a parameter that
# no rank used in a step gets a zero ``.grad`` instead of None (an optimizer with weight decay or momentum then
# still moves it); pass find_unused_parameters=True explicitly where that matters, and DDP's own search is used,
# untouched.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import engines
from ._registry import REGISTRY
from .distributed import log_rank0_once

logger = logging.getLogger("ddp_patches")


class _ZeroGradEdges(torch.autograd.Function):
    """Identity on the first ``n_outputs`` tensors; one gradient edge into each parameter after them.

    The edge carries nothing (None) unless ``defined_zeros``: then a zero tensor (NOTE [Static graph needs a
    defined zero]).
    """

    @staticmethod
    def forward(ctx, n_outputs: int, defined_zeros: bool, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)  # an output nobody backpropagates through must not become zeros
        ctx.params = tensors[n_outputs:] if defined_zeros else None
        ctx.n_params = len(tensors) - n_outputs
        return tuple(t.detach() for t in tensors[:n_outputs])

    @staticmethod
    def backward(ctx, *grads):
        zeros = [torch.zeros_like(p) for p in ctx.params] if ctx.params is not None else [None] * ctx.n_params
        return (None, None, *grads, *zeros)


# NOTE [Static graph needs a defined zero]
# With static_graph=True the reducer decides in its first iteration which parameters are unused, from the
# gradients that are *defined* when their hooks fire, and never again: a parameter first seen with an undefined
# gradient is treated as unused in every later step, its averaged gradient is never written back, and the ranks
# drift apart without an error (measured: 0.82 relative gradient error for a parameter used every other step).
# So under static_graph the edge carries a real zero, the parameter counts as used in every iteration, and the
# averaged gradient is written every step. Without static_graph an undefined gradient is enough and costs nothing.


def needed(ddp: nn.Module) -> bool:
    """Only a reducer that does not search for unused parameters itself needs the edges."""
    return not ddp.find_unused_parameters or bool(getattr(ddp, "static_graph", False))


def reachable_parameters(roots: list[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors (AccumulateGrad variables) that a backward from ``roots`` would reach."""
    found: set[int] = set()
    seen: set = set()
    stack = []
    for t in roots:
        if t.grad_fn is None:
            found.add(id(t))  # a leaf returned as an output
        else:
            stack.append(t.grad_fn)
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None and next_fn not in seen)
    return found


class UnusedParameterEdges:
    """Per DDP instance: edges for the trainable parameters a forward's outputs cannot reach."""

    def __init__(self, ddp: nn.Module) -> None:
        ignored = getattr(ddp, "parameters_to_ignore", set())
        owners: dict[int, list[int]] = {}  # id(parameter) -> ids of the modules that hold it directly
        self._params: dict[int, tuple[str, nn.Parameter]] = {}
        self._owner_modules: dict[int, nn.Module] = {}
        for mod_name, module in ddp.module.named_modules(remove_duplicate=False):
            direct = [(n, p) for n, p in module._parameters.items() if p is not None and p.requires_grad]
            direct = [(n, p) for n, p in direct if f"{mod_name}.{n}".lstrip(".") not in ignored]
            if not direct:
                continue
            self._owner_modules[id(module)] = module
            for n, p in direct:
                owners.setdefault(id(p), []).append(id(module))
                self._params.setdefault(id(p), (f"{mod_name}.{n}".lstrip("."), p))
        self._owners = [(pid, frozenset(mods)) for pid, mods in owners.items()]
        self._defined_zeros = bool(getattr(ddp, "static_graph", False))
        self._ran_no_grad: set[int] = set()  # owner modules that ran under no_grad in this forward
        self._active = False
        self.attached_last = 0

    def install(self, ddp: nn.Module) -> None:
        for module in self._owner_modules.values():
            REGISTRY.add_handle(module.register_forward_pre_hook(self._ran_hook))
        REGISTRY.add_handle(ddp.register_forward_pre_hook(self._begin))
        REGISTRY.add_handle(ddp.module.register_forward_hook(self._attach))
        REGISTRY.add_handle(ddp.register_forward_hook(self._end))

    def _ran_hook(self, module, args) -> None:
        if self._active and not torch.is_grad_enabled():
            self._ran_no_grad.add(id(module))

    def _begin(self, ddp, args) -> None:
        self._ran_no_grad.clear()
        # Under dynamo the walk cannot run (no autograd graph while tracing): step aside (NOTE [Engines]).
        self._active = torch.is_grad_enabled() and not engines.compiling()

    def _end(self, ddp, args, output) -> None:
        self._active = False

    def unused(self, roots: list[torch.Tensor]) -> list[tuple[str, nn.Parameter]]:
        """Trainable parameters ``roots`` cannot reach, except those whose module ran under no_grad."""
        reached, no_grad = reachable_parameters(roots), self._ran_no_grad
        return [self._params[pid] for pid, mods in self._owners if pid not in reached and no_grad.isdisjoint(mods)]

    def _attach(self, module, args, output):
        if not self._active:
            return None
        self._active = False  # one attachment per DDP forward, also if the inner module is called again
        leaves, spec = pytree.tree_flatten(output)
        slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        unused = self.unused([leaves[i] for i in slots]) if slots else []
        self.attached_last = len(unused)
        if not unused:
            return None
        log_rank0_once("unused-edges", logging.INFO,
                       "ddp_patches: %d trainable parameter(s) cannot get a gradient from this forward (e.g. %s); "
                       "each gets one zero-gradient edge so DDP's reducer sees its hook once (NOTE [Unused "
                       "parameters without find_unused_parameters] in ddp_patches/reach.py)", len(unused), unused[0][0])
        aliased = _ZeroGradEdges.apply(len(slots), self._defined_zeros, *(leaves[i] for i in slots),
                                       *(p for _, p in unused))
        for i, t in zip(slots, aliased):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, spec)


def install(ddp: nn.Module) -> UnusedParameterEdges | None:
    """Attach the per-forward bookkeeping to ``ddp`` when its reducer needs it; return it (for tests)."""
    if not needed(ddp):
        return None
    edges = UnusedParameterEdges(ddp)
    edges.install(ddp)
    _instances[ddp] = edges
    return edges


def for_ddp(ddp: nn.Module) -> UnusedParameterEdges | None:
    """The bookkeeping installed on ``ddp`` (None when its reducer searches for unused parameters itself)."""
    return _instances.get(ddp)


_instances: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
