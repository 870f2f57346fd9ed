"""Mechanism 2: make DDP's reducer safe before the first step, without changing a setting the user chose.

Three measured failures, three small steps, each only when the process is distributed:

1. A trainable parameter that gets no gradient on some rank or iteration (LoRA on a vision tower and a
   text-only batch, an idle MoE expert) makes a reducer built with find_unused_parameters=False raise
   "Expected to have finished reduction in the prior iteration" (gloo) or hang (NCCL). The reducer's settings
   are left exactly as given (NOTE [find_unused is the user's]); ``ddp_patches.reach`` gives such a parameter
   one zero-gradient edge instead, so its hook fires once whatever the setting.
2. static_graph + gradient accumulation (NOTE [static graph first step]): the first backward under
   ``no_sync()`` trips ``expect_autograd_hooks_ INTERNAL ASSERT FAILED``; the first one is made a synced one.
3. The trainable-parameter set is checked at every training forward against the one the reducer was built
   with: a parameter unfrozen after wrapping is a clear error instead of silent drift; one frozen after wrapping
   is an error only at a backward the reducer would wait for (NOTE [A frozen parameter is judged at the backward]).

The settings are logged once on rank 0 at INFO. The library does no dummy forward: DDP installs its autograd
hooks at construction, and a no-grad forward installs nothing, so it would have no measured effect.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpointing, engines, guard, probes, reach, teardown, tiled_mlp
from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once

logger = logging.getLogger("ddp_patches")

TARGETS = ("DistributedDataParallel.__init__", "DistributedDataParallel.no_sync")

# The DDP settings worth reporting in the one log line.
_REPORTED = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb")


class TrainableParametersChangedError(RuntimeError):
    """Raised when parameters were frozen or unfrozen after the model was wrapped in DDP."""


# NOTE [find_unused is the user's]
# An earlier release forced find_unused_parameters=True whenever it was not passed explicitly. Measured, that
# turned working patterns into failures: accelerate's ``trigger_sync_in_backward`` (prepare_for_backward([])
# then marks every parameter unused before its real hook marks it again: "marked as ready twice"), DDP with a
# PowerSGD hook (ranks fall out of step; a gloo timeout or an NCCL hang), and five of PyTorch's own DDP tests;
# it also cost every step an extra all-reduce and the bucket rebuild, and hid an explicit Trainer
# ``ddp_find_unused_parameters=False`` (accelerate drops default values, so DDP never sees it as explicit).
# What the flag was for -- a trainable parameter without a gradient on some rank -- is now handled in the
# forward by ``reach`` (edges only for parameters the outputs cannot reach, only when the reducer does not
# search itself), so the setting the user, the Trainer or TRL chose is passed to DDP untouched. With
# non-reentrant checkpointing (ddp_patches.checkpointing) both values of the flag and static_graph train.


# NOTE [A frozen parameter is judged at the backward]
# DDP's reducer is built with the parameters that are trainable at construction and registers their hooks once.
# What a later change of that set does without the library (measured, 2 gloo ranks):
#   * A parameter unfrozen after wrapping is not in the reducer: it trains on each rank's data alone and the ranks
#     drift apart silently (peft's disable_adapter() does this on exit to an adapter weight frozen before
#     wrapping: set_adapter() sets requires_grad=True on every active adapter weight). Always an error, at the
#     training forward that sees it.
#   * A parameter frozen after wrapping fires no hook. With find_unused_parameters=True and no static graph the
#     reducer's own graph search marks it unused in every step: progressive freezing (model.module[0]
#     .requires_grad_(False) after a few steps) trains, equal to a single process. Nothing to check there.
#   * With find_unused_parameters=False or static_graph=True the reducer waits for it, but only after a synced
#     backward through a forward that ran with it frozen ("Expected to have finished reduction in the prior
#     iteration" at the next forward). A forward alone is harmless: peft's disable_adapter() freezes every
#     adapter weight (BaseTunerLayer.enable_adapters(False)) for a reference forward whose output is detached
#     (DPO/KTO written by hand, no separate reference model), and that trains without the library.
# So a frozen parameter is never refused at the forward. Where the reducer would wait for it, the forward's
# outputs get a gradient hook, and a backward through them that will not run the parameter's AccumulateGrad
# while it is still frozen raises TrainableParametersChangedError there, in the step of the change, naming it (a
# reference output that is detached, or backpropagated after the adapters are enabled again, passes). The
# unused-parameter rescue (ddp_patches/reach.py) is no way out: it cannot give a frozen leaf an edge (measured:
# "element 0 of tensors does not require grad" inside backward(), or the reducer left waiting); made to fire the
# hook anyway (requires_grad set around its nested backward), it trained exactly as find_unused_parameters=True
# (AdamW with weight decay, 0.0 difference), but that would make a failing configuration train behind the user's
# setting, so the error stays and names find_unused_parameters=True as the setting that copes.
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
        if current == self.expected:
            return
        if current - self.expected:
            raise TrainableParametersChangedError(_changed_message(self.expected, current))
        frozen = self.expected - current
        if not reach.needed(ddp):  # the reducer searches for unused parameters itself
            log_rank0_once("frozen-after-wrapping", logging.INFO,
                           "ddp_patches: %d parameter(s) frozen after DistributedDataParallel was built (e.g. %s); "
                           "find_unused_parameters=True: the reducer treats them as unused, as without the library",
                           len(frozen), min(frozen))
        elif ddp.require_backward_grad_sync:  # under no_sync the reducer waits for nothing
            self._watch = frozen

    def after_forward(self, ddp: DDP, args: Any, output: Any) -> None:
        watch, self._watch = self._watch, frozenset()
        if watch:
            reach.map_tensors(output, _in_graph, lambda ts: [self._judge_at_backward(t, ddp, watch) for t in ts])

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
# The trainable set is read at every training forward. Walking ``named_parameters()`` for it cost 100 ms per
# forward on an MoE with LoRA on 2,560 experts (64,665 modules, 10,336 trainable tensors; benchmarks/ddp_overhead
# --config many-tensors), more than the step's own compute. The walk only finds something new when a module gained
# a parameter or a submodule, and torch announces both to global registration hooks; so the walk is redone only
# after such an announcement (anywhere: a counter, bumped), and every other forward reads the ``requires_grad``
# flags of the parameters listed last time (2 ms there). A module assigned again to the name it already has (Switch
# Transformers' router does it in every forward) announces nothing new and does not count.
_registrations = [0]  # bumped by torch's global module/parameter registration hooks while the reducer patch is on


def _parameter_registered(module, name, param) -> None:
    _registrations[0] += 1


def _module_registered(module, name, submodule) -> None:
    if module._modules.get(name) is not submodule:
        _registrations[0] += 1


class _ParameterListing:
    """A DDP's (name, parameter) list, walked again only after a registration (NOTE [The trainable set without a
    walk per forward])."""

    def __init__(self, ddp: DDP) -> None:
        self._ddp = weakref.ref(ddp)  # held by a hook of that DDP: no reference cycle to delay freeing its reducer
        self._seen = -1
        self._named: list[tuple[str, torch.nn.Parameter]] = []
        self._flags: list[bool] = []
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
            self._seen, self._flags = _registrations[0], []
        flags = [p.requires_grad for _, p in self._named]
        if flags != self._flags:
            self._flags = flags
            self._names = frozenset(n for (n, _), trainable in zip(self._named, flags) if trainable)
        return self._names


def _watch_registrations() -> None:
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


def _patched_ddp_init(original_init):
    def __init__(self, *args, **kwargs):
        module = args[0] if args else kwargs.get("module")
        if is_distributed() and isinstance(module, torch.nn.Module):
            checkpointing.check_recompute_routing(module)  # before DDP's first collective, on every rank alike
        original_init(self, *args, **kwargs)  # the settings as given: NOTE [find_unused is the user's]
        if not is_distributed():
            return
        engines.own(self)  # NOTE [The engine is the module's owner's]
        tiled_mlp.discover(self.module)  # no-op unless apply(tiled_mlp=True): NOTE [MLPs found by structure]
        TrainableGuard(self).install(self)  # before reach: its hooks see DDP's own outputs
        reach.install(self)
        teardown.track(self)
        guard.track(self)  # no-op unless the guard is on (ddp_patches/guard.py)
        _log_settings(self, reach.needed(self))

    return __init__


def warn_unprotected() -> None:
    """One WARNING when DDP instances built before apply() exist: they got none of the per-instance protection
    (their hooks are installed at construction), and nothing here can add it without a forward of theirs."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return  # no process group, so no DDP yet: skip the scan
    import gc

    # type(), not isinstance(): the heap holds weak proxies, and isinstance() on a dead one raises
    count = sum(1 for o in gc.get_objects() if issubclass(type(o), DDP) and reach.for_ddp(o) is None)
    if count:
        log_rank0_once("unprotected-ddp", logging.WARNING,
                       "ddp_patches: %d DistributedDataParallel instance(s) were built before apply() and are not "
                       "protected (no unused-parameter rescue, no trainable-set check); call apply() before building "
                       "DDP, the Trainer or accelerator.prepare", count)


def _log_settings(ddp: DDP, edges: bool) -> None:
    settings = ", ".join(f"{k}={getattr(ddp, k, None)}" for k in _REPORTED if hasattr(ddp, k))
    how = ("a parameter without a gradient fires its hook once at the end of backward (ddp_patches.reach)" if edges
           else "unused parameters are found by DDP itself")
    log_rank0_once(f"ddp-settings:{settings}", logging.INFO,
                   "ddp_patches: DistributedDataParallel built with %s (as given); %s", settings, how)


# NOTE [static graph first step]
# With static_graph=True, DDP's _DDPSink enqueues reducer._delay_all_reduce after the first backward it sees.
# Under no_sync() the forward skipped prepare_for_backward, so that first delayed all-reduce finds the
# reducer not expecting hooks: "expect_autograd_hooks_ INTERNAL ASSERT FAILED" (open upstream). Measured: if
# the first backward is a synced one, later no_sync accumulation works. So until DDP records that delayed
# all-reduce, no_sync() does not disable synchronisation. Gradients stay exact, because averaging is linear:
# the first micro-batch's gradient is averaged early (identical on every rank), and the later synced
# backward averages (that average + each rank's remaining local sum) to the same total. The cost is one
# extra all-reduce, in the first optimizer step only.
def _needs_synced_first_backward(ddp: DDP) -> bool:
    return bool(getattr(ddp, "static_graph", False)) and not getattr(
        ddp, "_static_graph_delay_allreduce_enqueued", True
    )


def _patched_no_sync(original_no_sync):
    @contextlib.contextmanager
    def no_sync(self):
        if is_distributed() and _needs_synced_first_backward(self):
            log_rank0_once(
                "static-graph-first-sync",
                logging.INFO,
                "ddp_patches: static_graph=True: the first backward is synchronised even under no_sync() "
                "(avoids expect_autograd_hooks_ INTERNAL ASSERT FAILED; see NOTE [static graph first step])",
            )
            yield
            return
        with original_no_sync(self):
            yield

    return no_sync


def _patch_ddp_init() -> None:
    REGISTRY.install(DDP, "__init__", _patched_ddp_init)


def _patch_ddp_no_sync() -> None:
    REGISTRY.install(DDP, "no_sync", _patched_no_sync)


# -- what the reducer patches assume (NOTE [Probed assumptions] in ddp_patches/probes.py) -----------------------
def _check_ddp_attributes() -> None:
    """DDP still keeps the settings and state the patches read on the instance (only its source shows them)."""
    probes.source_mentions(DDP, "find_unused_parameters", "static_graph", "require_backward_grad_sync",
                           "parameters_to_ignore", "process_group", "self.reducer", "_active_ddp_module")


def _check_static_graph_flag() -> None:
    probes.source_mentions(DDP, "_static_graph_delay_allreduce_enqueued")


ASSUMPTIONS = (
    probes.Assumption("ddp-attributes", "DistributedDataParallel keeps find_unused_parameters, static_graph, "
                      "require_backward_grad_sync, parameters_to_ignore, process_group, reducer and "
                      "_active_ddp_module as attributes", _check_ddp_attributes),
    *reach.ASSUMPTIONS,
)
NO_SYNC_ASSUMPTIONS = (
    probes.Assumption("static-graph-flag", "DDP records its first static-graph delayed all-reduce in "
                      "_static_graph_delay_allreduce_enqueued (NOTE [static graph first step])",
                      _check_static_graph_flag),
)


def install() -> list[str]:
    if not probes.verify("reducer", ASSUMPTIONS, "DDP runs as without the library (no unused-parameter rescue, no "
                         "trainable-set check, no static-graph first sync)"):
        return []
    _patch_ddp_init()
    _watch_registrations()
    targets = [TARGETS[0], *reach.patch_join_hook(), *reach.patch_finalize_backward()]
    if probes.verify("no_sync", NO_SYNC_ASSUMPTIONS, "static_graph=True with gradient accumulation may hit "
                     "'expect_autograd_hooks_ INTERNAL ASSERT FAILED' as without the library"):
        _patch_ddp_no_sync()
        targets.append(TARGETS[1])
    return targets + teardown.install()

