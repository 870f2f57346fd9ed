"""Every activation checkpoint is non-reentrant where DDP (or DeepSpeed ZeRO-1/2) runs the checkpointed module.

``install()`` replaces ``torch.utils.checkpoint.CheckpointFunction`` with a subclass that, under those engines,
calls ``checkpoint(..., use_reentrant=False)`` instead, and is the original call everywhere else
(NOTE [Why non-reentrant]). ``check_recompute_routing(model)`` raises ``RecomputeRoutingError`` for a MoE router
that draws random numbers while its checkpoints drop the RNG state.
"""

from __future__ import annotations

import inspect
import logging
import threading

import torch
import torch.distributed as torch_distributed
import torch.utils.checkpoint as torch_checkpoint

from . import engines, probes
from .offload import offloader as offload
from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once

logger = logging.getLogger("ddp_patches")

TARGET = "torch.utils.checkpoint.CheckpointFunction"


_SWAP_LINE = {
    engines.DDP: "ddp_patches: activation checkpointing use_reentrant=True -> False under %s (world size %d): a "
                 "reentrant checkpoint fires DDP's gradient hooks in a separate backward pass ('marked as ready "
                 "twice'); gradients are unchanged. NOTE [Why non-reentrant] in ddp_patches/checkpointing.py; "
                 "apply(checkpointing=False) keeps it reentrant",
    engines.ZERO12: "ddp_patches: activation checkpointing use_reentrant=True -> False under %s (world size %d): "
                    "a reentrant checkpoint runs a weight's gradient hook once per region that uses it, and ZeRO "
                    "reduces it twice ('has already been reduced'); gradients are unchanged. "
                    "NOTE [Reentrant checkpoints under ZeRO-1/2] in ddp_patches/engines/zero.py; "
                    "apply(checkpointing=False) keeps it reentrant",
}


# NOTE [The swap calls torch's own checkpoint]
# Invariant: a tool's wrapper around ``torch.utils.checkpoint.checkpoint`` that forces its own ``use_reentrant``
# (ms-swift's trainer mixin ignores the caller's keyword) neither undoes the swap nor recurses forever; a wrapper
# that adds behaviour is kept.
# Rule: the swap calls the module attribute first, with the function wrapped to clear a per-thread "pending" flag
# when it starts. A call that arrives while the flag is set came back through such a wrapper before the function
# ran, and goes to torch's own ``checkpoint`` instead, found by following ``__wrapped__`` into
# torch/utils/checkpoint.py (past torch's dynamo guard, which matters only while compiling, when the swap never
# runs). A function that checkpoints itself has started, so its inner calls swap as usual. With no ``__wrapped__``
# to follow, the swap steps aside with one WARNING and the run goes on as unpatched.
# Test: tests/test_checkpointing.py::test_a_checkpoint_wrapper_that_forces_reentrant.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §6
class _Swapping(threading.local):
    pending = False  # the swap called checkpoint() and the checkpointed function has not started yet


_swapping = _Swapping()


def _started(function):
    """``function``, clearing the pending flag when it starts (``__wrapped__``: engines.module_of sees through it)."""

    def run(*args, **kwargs):
        _swapping.pending = False
        return function(*args, **kwargs)

    run.__wrapped__ = function
    return run


def _torch_checkpoint():
    """torch's own ``checkpoint`` function beneath whatever wrappers replaced the module attribute, or None."""
    found = torch_checkpoint.checkpoint
    for _ in range(16):
        code = getattr(found, "__code__", None)
        if (code is not None and getattr(found, "__name__", "") == "checkpoint"
                and code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py")):
            return found
        found = getattr(found, "__wrapped__", None)
        if found is None:
            return None
    return None


def _say_forced_reentrant() -> None:
    wrapper = getattr(getattr(torch_checkpoint.checkpoint, "__code__", None), "co_filename", "?")
    log_rank0_once("checkpoint-forced-reentrant", logging.WARNING,
                   "ddp_patches: the checkpoint swap steps aside: a checkpoint(use_reentrant=False) call came back "
                   "as reentrant through torch.utils.checkpoint.checkpoint, which a wrapper defined in %s replaced "
                   "and which hides torch's own function (no __wrapped__); pass use_reentrant=False to the tool "
                   "that installed it. NOTE [The swap calls torch's own checkpoint] in ddp_patches/checkpointing.py",
                   wrapper)


# NOTE [Why non-reentrant]
# Invariant: where DDP runs the checkpointed module, every activation checkpoint, however it was called, is
# non-reentrant, so each parameter's AccumulateGrad hook fires exactly once per backward. A reentrant checkpoint
# recomputes its region in a separate graph task during backward: a parameter used in two reentrant regions fires
# its hook once per region ("Expected to mark a variable ready only once"); a region's forward ran under no_grad,
# so find_unused_parameters=True cannot reach its parameters from the output, marks them unused, and their real
# hook is a second mark; static_graph with accumulation hits the expect_autograd_hooks_ assert. Non-reentrant
# recomputes through saved-tensor hooks inside the outer graph task.
# Rule: replace the module global ``CheckpointFunction``, which ``checkpoint()`` looks up at call time for every
# reentrant call (a ``partial`` transformers bound before apply(), ``from ... import checkpoint``, peft's ``{}``
# kwargs, ``use_reentrant=True``, ``checkpoint_sequential``); non-reentrant calls are untouched. Nothing is lost:
# the reentrant path honours only ``preserve_rng_state``, which is passed on.
# Test: tests/test_checkpointing.py::test_ddp_runs_non_reentrant_with_rng_preserved.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §6
def _make_non_reentrant_under_ddp(original_cls: type) -> type:
    """Build the stand-in for ``CheckpointFunction``; it subclasses the original so type checks still hold."""

    class CheckpointFunction(original_cls):  # same name: error messages and grad_fn names read as usual
        @classmethod
        def apply(cls, function, preserve_rng_state, *args):  # the only call site is checkpoint()'s
            if not is_distributed() or engines.compiling():
                # Single process: exactly the original call, so results are bit-identical to no apply(). Under
                # dynamo: silent here (a log call would break the graph); the compile notice says it once.
                return original_cls.apply(function, preserve_rng_state, *args)
            engine = engines.of_function(function)  # NOTE [Recompute decides as the forward did]
            if not engines.acts("checkpointing", engine):
                engines.step_aside("checkpointing", engine)
                return original_cls.apply(function, preserve_rng_state, *args)
            call = torch_checkpoint.checkpoint  # with whatever a tool wrapped around it
            if _swapping.pending:  # NOTE [The swap calls torch's own checkpoint]: it came back before fn ran
                _swapping.pending = False
                call = _torch_checkpoint()
                if call is None:
                    _say_forced_reentrant()
                    return original_cls.apply(function, preserve_rng_state, *args)
            log_rank0_once(f"checkpoint-swap-{engine}", logging.WARNING, _SWAP_LINE[engine], engine,
                           torch_distributed.get_world_size())
            if offload.outer_save_on_cpu():  # NOTE [One offload at a time]
                offload.say_outer_offload_acts()
            before, _swapping.pending = _swapping.pending, True
            try:
                return call(_started(function), *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)
            finally:
                _swapping.pending = before

    CheckpointFunction.__qualname__ = original_cls.__qualname__
    CheckpointFunction.__module__ = original_cls.__module__
    return CheckpointFunction


# NOTE [A recompute must route as the forward did]
# Invariant: a checkpoint's recompute sends every token to the experts the forward chose. A MoE router with jitter
# (Mixtral's and PhiMoE's ``router_jitter_noise``, ``input_jitter_noise``) draws random numbers in training; with
# ``preserve_rng_state=False`` the recompute draws new noise and routes elsewhere: silently wrong gradients
# (reentrant) or CheckpointError "Recomputed values ... have different metadata" deep in backward (non-reentrant).
# With the default ``preserve_rng_state=True`` the recompute is exact.
# Rule: neither outcome is a working pattern, so when DDP wraps a model whose config asks for router noise and
# whose checkpointing does not preserve the RNG, this raises at once, naming the setting to change.
# Test: tests/test_moe.py::test_router_jitter_without_preserved_rng_is_a_clear_error.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §17
class RecomputeRoutingError(ValueError):
    """Checkpointing with preserve_rng_state=False on a model whose MoE router draws random numbers."""


def check_recompute_routing(model) -> None:
    """Raise RecomputeRoutingError for router noise with preserve_rng_state=False (NOTE above)."""
    if not any(_drops_rng_state(f) for f in gradient_checkpointing_funcs(model)):
        return
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    noisy = sorted({f"{k}={v}" for c in configs.values() for k, v in _config_items(c)
                    if "jitter" in k and isinstance(v, (int, float)) and v > 0})
    if not noisy:
        return
    raise RecomputeRoutingError(
        f"ddp_patches: this model's MoE router draws random numbers in training ({', '.join(noisy)}) and its "
        "activation checkpointing has preserve_rng_state=False: each backward recompute would route tokens to "
        "other experts than the forward did (a CheckpointError in backward, or silently different gradients "
        "with reentrant checkpoints). Expected preserve_rng_state=True (the default): drop it from "
        "gradient_checkpointing_kwargs, or set the jitter to 0. NOTE [A recompute must route as the forward did]"
    )


def _config_items(config) -> list:
    return list(config.to_dict().items()) if hasattr(config, "to_dict") else []


def gradient_checkpointing_funcs(model) -> list:
    """The checkpoint functions transformers bound on the layers of ``model`` that have checkpointing on."""
    if model is None:
        return []
    return [m._gradient_checkpointing_func for m in model.modules()
            if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]


def _drops_rng_state(func) -> bool:
    return (getattr(func, "keywords", None) or {}).get("preserve_rng_state", True) is False


def _patch_torch_checkpoint_function() -> None:
    REGISTRY.install(torch_checkpoint, "CheckpointFunction", _make_non_reentrant_under_ddp)


# -- what the swap assumes (NOTE [Probed assumptions] in ddp_patches/probes.py) ---------------------------------
def _check_reentrant_call_site() -> None:
    """checkpoint(use_reentrant=True) calls the module global CheckpointFunction.apply(function, preserve, *args),
    looked up at call time; the result's gradient is the direct one."""
    original = vars(torch_checkpoint).get("CheckpointFunction")
    probes.expect(isinstance(original, type) and issubclass(original, torch.autograd.Function),
                  f"torch.utils.checkpoint.CheckpointFunction is {original!r}, not an autograd.Function")
    calls = []

    class Spy(original):
        @classmethod
        def apply(cls, *args):
            calls.append(args)
            return original.apply(*args)

    def fn(t):
        return t * 3

    x = torch.ones(2, dtype=torch.float32, requires_grad=True)
    torch_checkpoint.CheckpointFunction = Spy
    try:  # unwrapped: torch's @_disable_dynamo wrapper would import dynamo (seconds) at apply()
        out = inspect.unwrap(torch_checkpoint.checkpoint)(fn, x, use_reentrant=True, preserve_rng_state=False)
    finally:
        torch_checkpoint.CheckpointFunction = original
    probes.expect(len(calls) == 1 and calls[0][0] is fn and calls[0][1] is False and calls[0][2] is x,
                  f"checkpoint(use_reentrant=True) made {len(calls)} call(s) to CheckpointFunction.apply, not one "
                  "with (function, preserve_rng_state, *args)")
    probes.expect(torch.equal(out.detach(), torch.full((2,), 3.0, dtype=torch.float32)) and out.grad_fn is not None,
                  "the reentrant checkpoint's output is wrong or not differentiable")


def _check_non_reentrant_keywords() -> None:
    """The swap calls checkpoint(function, *args, use_reentrant=False, preserve_rng_state=...)."""
    params = inspect.signature(torch_checkpoint.checkpoint).parameters
    missing = [k for k in ("use_reentrant", "preserve_rng_state") if k not in params
               and not any(p.kind is p.VAR_KEYWORD for p in params.values())]
    probes.expect(not missing, f"checkpoint() takes no {', '.join(missing)}")


def _check_engine_internals() -> None:
    """The swap asks ddp_patches.engines whether a backward is running and whether a DDP forward is active."""
    from torch.nn.parallel import DistributedDataParallel

    probes.has(torch._C, "_current_graph_task_id")
    probes.has(DistributedDataParallel, "_get_active_ddp_module")
    probes.expect(torch._C._current_graph_task_id() == -1, "_current_graph_task_id() outside a backward is not -1")


ASSUMPTIONS = (
    probes.Assumption("reentrant-call-site", "checkpoint(use_reentrant=True) calls the module global "
                      "torch.utils.checkpoint.CheckpointFunction.apply(function, preserve_rng_state, *args) "
                      "(NOTE [Why non-reentrant])", _check_reentrant_call_site),
    probes.Assumption("non-reentrant-keywords", "checkpoint() accepts use_reentrant= and preserve_rng_state=",
                      _check_non_reentrant_keywords),
    probes.Assumption("engine-internals", "torch._C._current_graph_task_id() (-1 outside a backward) and "
                      "DistributedDataParallel._get_active_ddp_module() exist (ddp_patches/engines/__init__.py)",
                      _check_engine_internals),
)


def install() -> list[str]:
    if not probes.verify("checkpointing", ASSUMPTIONS, "Reentrant checkpoints stay reentrant under DDP (no swap)"):
        return []
    _patch_torch_checkpoint_function()
    return [TARGET]
