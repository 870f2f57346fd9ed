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
# after the wrapped module's forward, every trainable parameter whose owning module did not run gets one edge
# from the outputs into its AccumulateGrad node, through ``_ZeroGradEdges``, whose backward returns None for it.
# Autograd still runs that AccumulateGrad node (with an undefined gradient it leaves ``.grad`` alone) and then
# its post-hooks, where DDP's reducer marks the parameter ready with a zero bucket slot -- the case reducer.cpp
# documents as "hooks can be fired with undefined grads". The average over ranks is then exactly what
# find_unused_parameters=True gives; nothing is allocated; the outputs are aliases (``detach()``), not copies,
# so in-place edits of them (``logits.div_(temperature)``) keep working.
#
# "Owning module did not run" rather than "not reachable in the autograd graph", on purpose: a parameter used
# inside a reentrant region (a custom autograd.Function that recomputes under no_grad and calls backward in
# its own backward) is unreachable from the outputs yet fires its hook later, in a nested graph task; an extra
# edge would make that a second mark. Its module ran, so it gets no edge, and such code keeps working. The
# price of the rule is coverage, never harm: a parameter whose module ran but which it did not use (a branch
# inside one module) is not rescued, exactly as without this library.
#
# Differences from find_unused_parameters=True, both stated in DDP_GRADIENT_CHECKPOINTING_FIX.md: a parameter
# that no rank used in a step gets a zero ``.grad`` instead of None (an optimizer with weight decay or momentum
# then still moves it); pass find_unused_parameters=True explicitly where that matters, and DDP's own search is
# used, untouched.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn
from torch.utils import _pytree as pytree

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


class UnusedParameterEdges:
    """Per DDP instance: which parameter-owning modules ran in this forward, and edges for the others."""

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
        self._ran: set[int] = set()
        self._active = False
        self.attached_last = 0

    def install(self, ddp: nn.Module) -> None:
        for module in self._owner_modules.values():
            REGISTRY.add_handle(module.register_forward_pre_hook(self._ran_hook))
        REGISTRY.add_handle(ddp.register_forward_pre_hook(self._begin))
        REGISTRY.add_handle(ddp.module.register_forward_hook(self._attach))
        REGISTRY.add_handle(ddp.register_forward_hook(self._end))

    def _ran_hook(self, module, args) -> None:
        if self._active:
            self._ran.add(id(module))

    def _begin(self, ddp, args) -> None:
        self._ran.clear()
        self._active = torch.is_grad_enabled()

    def _end(self, ddp, args, output) -> None:
        self._active = False

    def unused(self) -> list[tuple[str, nn.Parameter]]:
        """Trainable parameters none of whose owning modules ran since the DDP forward began."""
        ran = self._ran
        return [self._params[pid] for pid, mods in self._owners if ran.isdisjoint(mods)]

    def _attach(self, module, args, output):
        if not self._active:
            return None
        self._active = False  # one attachment per DDP forward, also if the inner module is called again
        unused = self.unused()
        self.attached_last = len(unused)
        if not unused:
            return None
        leaves, spec = pytree.tree_flatten(output)
        slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not slots:
            return None
        log_rank0_once("unused-edges", logging.INFO,
                       "ddp_patches: %d trainable parameter(s) were not used by this forward (e.g. %s); each gets "
                       "one zero-gradient edge so DDP's reducer sees its hook once (NOTE [Unused parameters "
                       "without find_unused_parameters] in ddp_patches/reach.py)", len(unused), unused[0][0])
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
