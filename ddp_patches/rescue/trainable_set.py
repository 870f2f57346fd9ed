"""The trainable-set guard: at each training forward of a DDP, its trainable parameters against the set its reducer
was built with. A parameter unfrozen after wrapping is refused at the forward; one frozen after wrapping only at a
backward the reducer would wait for (``TrainableParametersChangedError``, naming the parameters and the fix).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import engines
from .._registry import REGISTRY
from ..distributed import log_rank0_once
from .counts import needed
from .outputs import map_tensors


class TrainableParametersChangedError(RuntimeError):
    """Raised when parameters were frozen or unfrozen after the model was wrapped in DDP."""


# NOTE [A frozen parameter is judged at the backward]
# Invariant: the reducer's parameter list and hooks are fixed at construction. A parameter unfrozen after wrapping
# is not in it and would train on each rank's data alone: always an error, at the training forward that sees it. A
# parameter frozen after wrapping fires no hook; that fails only where the reducer waits for it
# (find_unused_parameters=False or static_graph=True) and only after a synced backward through a forward that ran
# with it frozen. A forward alone is harmless (peft's disable_adapter() freezes every adapter weight for a
# reference forward whose output is detached), and find_unused_parameters=True marks it unused every step.
# Rule: a frozen parameter is never refused at the forward. Where the reducer would wait for it, the forward's
# outputs get a gradient hook, and a backward through them that will not run the parameter's AccumulateGrad while
# it is still frozen raises TrainableParametersChangedError there, naming it and find_unused_parameters=True as
# the setting that copes. The unused-parameter rescue (ddp_patches/rescue/edges.py) does not fire a frozen parameter's
# hook: that would make a failing configuration train behind the user's setting.
# Test: tests/test_trainable_set.py::test_freezing_with_a_reducer_that_waits_is_a_clear_error_at_the_backward
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §5
class TrainableGuard:
    """Hooks on one DDP instance: the trainable set against the one the reducer was built with."""

    def __init__(self, ddp: DDP) -> None:
        self._listing = _ParameterListing(ddp)
        self.expected = self._listing.trainable_names()
        # The AccumulateGrad nodes the reducer hooks; every listed parameter requires grad now, and a frozen one's
        # node can no longer be asked for (get_gradient_edge raises).
        self._nodes = {n: get_gradient_edge(p).node for n, p in ddp.module.named_parameters() if n in self.expected}
        self._watch: frozenset[str] = frozenset()  # frozen in this forward, for a reducer that waits for them

    def __getstate__(self) -> dict:
        # A DDP is pickled or deep-copied with its hooks (PyTorch's own DDP tests do it); autograd nodes are neither.
        # Without nodes, a frozen parameter counts as one whose AccumulateGrad does not run.
        return {**self.__dict__, "_nodes": {}, "_watch": frozenset()}

    def install(self, ddp: DDP) -> None:
        REGISTRY.add_instance_handle(ddp.register_forward_pre_hook(self.before_forward))
        REGISTRY.add_instance_handle(ddp.register_forward_hook(self.after_forward))

    def before_forward(self, ddp: DDP, args: Any) -> None:
        self._watch = frozenset()
        if not (ddp.training and torch.is_grad_enabled()) or engines.compiling():
            return
        self._listing.bind(ddp)
        current = self._listing.trainable_names()
        if current is self.expected or current == self.expected:  # the listing returns the same set while unchanged
            return
        if current - self.expected:
            raise TrainableParametersChangedError(_changed_message(self.expected, current))
        frozen = self.expected - current
        if not needed(ddp):  # the reducer searches for unused parameters itself
            log_rank0_once("frozen-after-wrapping", logging.INFO,
                           "ddp_patches: %d parameter(s) frozen after DistributedDataParallel was built (e.g. %s); "
                           "find_unused_parameters=True: the reducer treats them as unused, as without the library",
                           len(frozen), min(frozen))
        elif ddp.require_backward_grad_sync:  # under no_sync the reducer waits for nothing
            self._watch = frozen

    def after_forward(self, ddp: DDP, args: Any, output: Any) -> None:
        watch, self._watch = self._watch, frozenset()
        if watch:
            map_tensors(output, _in_graph, lambda ts: [self._judge_at_backward(t, ddp, watch) for t in ts])

    def _judge_at_backward(self, t: torch.Tensor, ddp: DDP, watch: frozenset[str]) -> torch.Tensor:
        t.register_hook(lambda grad: self._check_backward(ddp, watch))
        return t

    def _check_backward(self, ddp: DDP, watch: frozenset[str]) -> None:
        params = dict(ddp.module.named_parameters())
        frozen = [n for n in watch if not params[n].requires_grad]
        if not frozen:
            return  # enabled again since the forward (a reference output backpropagated after disable_adapter())
        try:
            if not self._accumulates():
                return  # autograd.grad(), or a backward that reaches none of the DDP's parameters: no reduction
            waiting = sorted(n for n in frozen if not self._will_run(n))
        except RuntimeError:  # "A leaf node was passed ... but we are currently running autograd.grad()"
            return
        if waiting:  # a parameter frozen after this forward's graph was recorded still runs its hook
            raise TrainableParametersChangedError(
                _changed_message(self.expected, self.expected - frozenset(waiting), waiting=_waiting_line(ddp)))

    def _accumulates(self) -> bool:
        # Without the nodes (a copied DDP), every backward counts as one that accumulates.
        return not self._nodes or any(torch._C._will_engine_execute_node(n) for n in self._nodes.values())

    def _will_run(self, name: str) -> bool:
        node = self._nodes.get(name)
        return node is not None and torch._C._will_engine_execute_node(node)


def _in_graph(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None


def _waiting_line(ddp: DDP) -> str:
    setting = "static_graph=True" if getattr(ddp, "static_graph", False) else "find_unused_parameters=False"
    return (f"  A synced backward runs through a forward that ran with them frozen; with {setting} the reducer waits "
            "for their gradients (without the library: 'Expected to have finished reduction in the prior iteration' "
            "at the next forward). find_unused_parameters=True (without static_graph) lets DDP treat parameters "
            "frozen later as unused.")


# NOTE [The trainable set without a walk per forward]
# Invariant: every training forward sees the current trainable set without walking ``named_parameters()``, whose
# cost grows with the model (on a large MoE with LoRA it exceeded the step's compute).
# Rule: the walk only finds something new when a module gained a parameter or a submodule, and torch announces both
# to global registration hooks; so it is redone only after such an announcement (anywhere: a counter, bumped), and
# every other forward reads the ``requires_grad`` flags of the parameters listed last time. A module assigned again
# to the name it already has (Switch Transformers' router, every forward), or a listed module registered into another
# container (Llama's ``self.layers[:n]`` builds a new ModuleList every forward) brings nothing new and does not count.
# Test: tests/test_reducer.py::test_trainable_set_change_is_a_clear_error (cost: benchmarks/ddp_overhead.py
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §5
# --config many-tensors)
_registrations = [0]  # bumped by torch's global module/parameter registration hooks while the reducer patch is on
_listed: weakref.WeakSet = weakref.WeakSet()  # the modules of every tree listed since (their parameters are known)


def _parameter_registered(module, name, param) -> None:
    _registrations[0] += 1


def _module_registered(module, name, submodule) -> None:
    # A WeakSet lookup cannot be traced by dynamo (its guards index the set's internals): while compiling, count it.
    if module._modules.get(name) is not submodule and (engines.compiling() or submodule not in _listed):
        _registrations[0] += 1


_REQUIRES_GRAD = torch.Tensor.requires_grad.__get__  # the C getter: half a Parameter's attribute lookup


class _ParameterListing:
    """A DDP's (name, parameter) list, walked again only after a registration
    (NOTE [The trainable set without a walk per forward])."""

    def __init__(self, ddp: DDP) -> None:
        self._ddp = weakref.ref(ddp)  # held by a hook of that DDP: no reference cycle to delay freeing its reducer
        self._seen = -1
        self._named: list[tuple[str, torch.nn.Parameter]] = []
        self._flags: list[bool] = []
        self._params: list[torch.nn.Parameter] = []
        self._names: frozenset[str] = frozenset()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ddp": None, "_seen": -1}  # a copy lists its own DDP (TrainableGuard.bind)

    def bind(self, ddp: DDP) -> None:
        if self._ddp is None or self._ddp() is not ddp:
            self._ddp, self._seen = weakref.ref(ddp), -1

    def trainable_names(self) -> frozenset[str]:
        if self._seen != _registrations[0]:
            ddp = self._ddp()
            ignored = getattr(ddp, "parameters_to_ignore", set())
            self._named = [(n, p) for n, p in ddp.module.named_parameters() if n not in ignored]
            _listed.update(ddp.module.modules())
            self._params = [p for _, p in self._named]
            self._seen, self._flags = _registrations[0], []
        flags = list(map(_REQUIRES_GRAD, self._params))  # C-speed: 16k parameters in about 1 ms
        if flags != self._flags:
            self._flags = flags
            self._names = frozenset(n for (n, _), trainable in zip(self._named, flags) if trainable)
        return self._names


def watch_registrations() -> None:
    """Count module and parameter registrations anywhere (NOTE [The trainable set without a walk per forward])."""
    from torch.nn.modules import module as nn_module

    REGISTRY.add_handle(nn_module.register_module_parameter_registration_hook(_parameter_registered))
    REGISTRY.add_handle(nn_module.register_module_module_registration_hook(_module_registered))


def _changed_message(expected: frozenset[str], current: frozenset[str], waiting: str = "") -> str:
    added = sorted(current - expected)
    removed = sorted(expected - current)
    lines = ["ddp_patches: the trainable parameters changed after the model was wrapped in DistributedDataParallel."]
    if added:
        lines.append(f"  now trainable, but not when DDP was built (they would never be synchronised): {_some(added)}")
    if removed:
        lines.append(f"  trainable when DDP was built, frozen now (the reducer would wait for them): {_some(removed)}")
    if waiting:
        lines.append(waiting)
    lines.append("  DDP registers its gradient hooks once, at construction. Freeze/unfreeze parameters and add "
                 "adapters before wrapping (before Trainer/SFTTrainer or accelerator.prepare), or build a new "
                 "DistributedDataParallel after the change.")
    return "\n".join(lines)


def _some(names: list[str], shown: int = 8) -> str:
    return f"{names[:shown]}" + (f" and {len(names) - shown} more" if len(names) > shown else "")
