"""Which engine runs the model a patch is acting for, decided at call time, and where each patch acts.

``of_module`` / ``of_function`` name the engine running a module now (DDP, FSDP2, FSDP1, DeepSpeed ZeRO-0,
ZeRO-1/2 or ZeRO-3, torch.compile, or none); ``acts`` and ``step_aside`` apply ``ACTS_UNDER`` (NOTE [Engines]).
``expected_from_environment``, ``expected_from_args`` and ``summary`` say what a launch sets up (apply()'s report,
the doctor); ``install_compile_notice`` arms the one WARNING under torch.compile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from . import zero
from .._registry import REGISTRY
from ..distributed import log_rank0_once

logger = logging.getLogger("ddp_patches")

DDP = "DDP"
FSDP2 = "FSDP2"
FSDP1 = "FSDP1"
DEEPSPEED = "DeepSpeed"  # ZeRO-3, or a stage no one has told us
ZERO12 = "DeepSpeed ZeRO-1/2"
ZERO0 = "DeepSpeed ZeRO-0"
COMPILE = "torch.compile"
NONE = "no engine"

# NOTE [Engines]
# Invariant: a patch acts only under the engines it is proven for (a test with gradient parity against a single
# process); under any other it calls the original and says why, once, at WARNING on rank 0 (``step_aside``).
#   * the checkpoint swap: DDP (NOTE [Why non-reentrant]) and ZeRO-1/2 (NOTE [Reentrant checkpoints under ZeRO-1/2]).
#     FSDP2 and ZeRO-0 have no per-parameter hook to confuse, so reentrant checkpoints train there as asked; under
#     ZeRO-3 non-reentrant checkpoints are reported to fail on partitioned frozen weights, and TRL forces reentrant.
#   * offload and the tiled MLP: DDP, FSDP2 and ZeRO-1/2, whose parameters are ordinary tensors during forward and
#     backward. The reducer patches: DDP, by construction.
#   * torch.compile: dynamo traces checkpoints as its own operator, so swap and offload are not reached inside
#     compiled code, and the tiled MLP and the rescue step aside while dynamo traces; the compile notice says so.
# Rule: each patch asks ``of_module`` / ``of_function`` at call time and acts only where ACTS_UNDER lists that
# engine. Every cell of ACTS_UNDER is a test (docs/engines.md).
# Test: tests/test_engines.py::test_fsdp2_says_once_what_steps_aside.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §14
ACTS_UNDER: dict[str, tuple[str, ...]] = {
    "checkpointing": (DDP, ZERO12),
    "reducer": (DDP,),
    "offload": (DDP, FSDP2, ZERO12),
    "tiled_mlp": (DDP, FSDP2, ZERO12),
    "tiled_attention": (DDP, FSDP2, ZERO12),
    "chunked_loss": (DDP, FSDP2, ZERO12),
}

_WHY: dict[tuple[str, str], str] = {
    ("checkpointing", FSDP2): "FSDP2 has no DDP reducer; reentrant checkpoints train there with gradient parity, "
                              "so they stay as asked (offload acts only on non-reentrant ones: pass "
                              "use_reentrant=False to offload them)",
    ("checkpointing", DEEPSPEED): "non-reentrant checkpoints are reported to fail under ZeRO-3 on partitioned frozen "
                                  "weights (CheckpointError ... shape [0]) and TRL forces reentrant for PEFT there",
    ("checkpointing", ZERO0): "without ZeRO, DeepSpeed averages gradients after backward with no per-parameter hook; "
                              "reentrant checkpoints train there as asked",
    ("checkpointing", COMPILE): "dynamo traces checkpoints as its own operator; compiled DDP trains with reentrant "
                                "checkpoints as they are",
    ("checkpointing", NONE): "no DistributedDataParallel forward is running around this checkpoint and no DeepSpeed "
                             "ZeRO-1/2 engine built after apply() runs it (the model is not wrapped in DDP, the "
                             "checkpoint wraps the DDP itself, a DeepSpeed engine was built before apply(), or an "
                             "engine this library does not know runs it)",
}


def _why(patch: str, engine: str) -> str:
    if (patch, engine) in _WHY:
        return _WHY[(patch, engine)]
    if engine == COMPILE:
        return "dynamo is tracing this code; compiled code runs without it"
    if engine == NONE:
        return "the model runs under no engine this library has proven it under (DDP, FSDP2, DeepSpeed ZeRO-1/2)"
    return f"it is not proven under {engine}"


def acts(patch: str, engine: str) -> bool:
    return engine in ACTS_UNDER[patch]


def step_aside(patch: str, engine: str) -> None:
    """One WARNING line on rank 0, once per process, patch and engine."""
    log_rank0_once(f"engine-{patch}-{engine}", logging.WARNING,
                   "ddp_patches: %s steps aside under %s: %s (NOTE [Engines] in ddp_patches/engines/__init__.py)",
                   _LABELS.get(patch, patch), engine, _why(patch, engine))


_LABELS = {"checkpointing": "the checkpoint swap (use_reentrant=True -> False)", "offload": "activation offload",
           "tiled_mlp": "the tiled MLP", "tiled_attention": "the tiled attention",
           "reducer": "the unused-parameter rescue", "chunked_loss": "the chunked LM loss"}


# -- detection -------------------------------------------------------------------------------------------------
# NOTE [Recompute decides as the forward did]
# Invariant: a call made during a non-reentrant checkpoint's recompute takes the path its forward took. DDP's
# forward marker is unset during backward, yet the recompute re-runs the region's forward code there; a tiled MLP
# or a nested checkpoint that decided differently would save different tensors (CheckpointError: "Recomputed
# values ... have different metadata").
# Rule: the engine found in a forward is kept per module, and a call made while a backward runs reuses it.
# Test: tests/test_tiled_mlp.py::test_parity_across_ddp_modes (its checkpointed modes).
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §14
_decided: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
_last: dict[str, str | None] = {"engine": None}


def of_module(module: nn.Module | None) -> str:
    """The engine running ``module`` now (None: only what the process says, without a module)."""
    if compiling():
        return COMPILE
    if torch._C._current_graph_task_id() != -1:  # inside backward: recomputation
        kept = _decided.get(module) if module is not None else None
        if kept is not None or _last["engine"] is not None:
            return kept or _last["engine"]
    engine = _detect(module)
    if module is not None:
        _decided[module] = engine
    _last["engine"] = engine
    return engine


def forget() -> None:
    """Drop the decisions kept for recomputation (at every revert: NOTE [Each module forgets its own state])."""
    _decided.clear()
    _last["engine"] = None


REGISTRY.on_reset(forget)


_stand_in: list[str] = []


@contextlib.contextmanager
def acting_as(engine: str) -> Iterator[None]:
    """Inside this block the patches treat every module as run by ``engine``. For a single-process replica that
    stands in for a distributed model (gradient-parity references): the patches then act on the replica exactly
    as on the model it is compared with."""
    _stand_in.append(engine)
    try:
        yield
    finally:
        _stand_in.pop()


# NOTE [The engine is the module's owner's]
# The engine a call acts for is the one that runs the module being called, not a process-wide switch: a DDP
# student beside a ZeRO-3 teacher (an HfDeepSpeedConfig alive for the teacher) is still DDP's, and its reentrant
# checkpoints still need the swap. So module-level evidence comes first (partitioned parameters: DeepSpeed; a
# DDP forward running, or a module that a live DDP wraps: DDP; a sharding registration: FSDP), and the
# process-wide ZeRO-3 switch decides only where the module says nothing (no module, or one outside any wrapper).
# Test: tests/test_engines.py::test_a_ddp_student_beside_a_zero3_teacher_is_ddps.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §14
_owned_by_ddp: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def own(ddp: nn.Module) -> None:
    """Record the modules a DDP wraps (the reducer patch calls it at construction)."""
    ref = weakref.ref(ddp)
    for m in ddp.module.modules():
        _owned_by_ddp[m] = ref


def _wrapped_by_live_ddp(module: nn.Module) -> bool:
    ref = _owned_by_ddp.get(module)
    return ref is not None and ref() is not None


def _detect(module: nn.Module | None) -> str:
    """The engine by the cheapest evidence first (``of_module`` has ruled out compiling; an ``acting_as`` block
    overrides all):

    1. DeepSpeed ZeRO-3: partitioned parameters (``ds_id``) on the module.
    2. DDP: ``DistributedDataParallel._active_ddp_module``, which DDP sets for the length of its forward (dynamo's
       DDPOptimizer reads the same marker), or a module a live DDP wraps (a loss-side checkpoint of the head).
    3. FSDP2 / FSDP1: the module lies under one that ``fully_shard`` (or FSDP1) registered in torch's
       composable-state table, or holds FSDP1's flattened parameters (cached per module).
    4. DeepSpeed by its engine: one built while applied runs the module, or an engine's forward is running (a
       checkpointed closure); its ZeRO stage, read at call time, names the engine (zero.py).
    5. transformers' ``is_deepspeed_zero3_enabled()``, only where 1-4 found nothing
       (NOTE [The engine is the module's owner's]); else "no engine".
    """
    if _stand_in:
        return _stand_in[-1]
    if module is not None and _has_partitioned_parameters(module):
        return DEEPSPEED
    if ddp_forward_active() or (module is not None and _wrapped_by_live_ddp(module)):
        return DDP
    sharded = _sharded_engine(module) if module is not None else None
    if sharded is not None:
        return sharded
    stage = zero.stage_of(module)
    if stage is not None:
        return _of_stage(stage)
    return DEEPSPEED if deepspeed_zero3() else NONE


def _of_stage(stage: int | None) -> str:
    """The engine label of a DeepSpeed ZeRO stage (NOTE [Reentrant checkpoints under ZeRO-1/2] in zero.py)."""
    return {0: ZERO0, 1: ZERO12, 2: ZERO12}.get(stage, DEEPSPEED)


def of_function(function: Any) -> str:
    """The engine running the module behind a checkpointed function (see ``module_of``)."""
    return of_module(module_of(function))


def module_of(function: Any) -> nn.Module | None:
    """The module behind ``function``: itself, the owner of a bound method, or a partial's first positional
    argument (transformers >= 5 checkpoints ``partial(forward, layer, **kwargs)``)."""
    for _ in range(4):
        if isinstance(function, nn.Module):
            return function
        owner = getattr(function, "__self__", None)
        if isinstance(owner, nn.Module):
            return owner
        if isinstance(function, functools.partial):
            if function.args and isinstance(function.args[0], nn.Module):
                return function.args[0]
            function = function.func
        else:
            function = getattr(function, "__wrapped__", None)
        if function is None:
            return None
    return None


def compiling() -> bool:
    return torch.compiler.is_compiling()


def ddp_forward_active() -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module() is not None


# NOTE [Unreadable third-party state is not that engine]
# Invariant: detection never raises on another library's half-built state. transformers registers its global
# DeepSpeed config before checking that deepspeed is installed, so a ``TrainingArguments(deepspeed=...)`` that failed
# (PackageNotFoundError) leaves a config without its ZeRO stage, and ``is_deepspeed_zero3_enabled()`` raises
# AttributeError from then on -- which made every later apply() crash.
# Rule: a detector that cannot read such state logs one WARNING line (once, rank 0) naming what raised, and answers
# "not that engine".
# Test: tests/test_engines.py::test_a_half_built_hf_deepspeed_config_is_not_zero3
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §14
def deepspeed_zero3() -> bool:
    """transformers' own ZeRO-3 switch (an HfDeepSpeedConfig is alive); never imports transformers."""
    integration = sys.modules.get("transformers.integrations.deepspeed")
    if integration is None:
        return False
    try:
        return bool(integration.is_deepspeed_zero3_enabled())
    except Exception as e:  # NOTE [Unreadable third-party state is not that engine]
        log_rank0_once("engine-hf-deepspeed-unreadable", logging.WARNING,
                       "ddp_patches: transformers' global DeepSpeed config cannot be read (is_deepspeed_zero3_enabled()"
                       " raised %s: %s; typically left by a TrainingArguments(deepspeed=...) that failed): taken as "
                       "no DeepSpeed ZeRO-3", type(e).__name__, e)
        return False


def _has_partitioned_parameters(module: nn.Module) -> bool:
    first = next(module.parameters(), None)
    return first is not None and hasattr(first, "ds_id")


_sharded_cache: "weakref.WeakKeyDictionary[nn.Module, tuple[int, str | None]]" = weakref.WeakKeyDictionary()


def _sharded_engine(module: nn.Module) -> str | None:
    """FSDP2 or FSDP1 when ``module`` lies under a module either registered, else None. Cached per module until
    the registry changes size (a model sharded after the first call is still found)."""
    from torch.distributed import _composable_state

    table = _composable_state._module_state_mapping
    cached = _sharded_cache.get(module)
    if cached is not None and cached[0] == len(table):
        return cached[1]
    found = _find_sharded(module, table)
    _sharded_cache[module] = (len(table), found)
    return found


def _find_sharded(module: nn.Module, table) -> str | None:
    from torch.distributed.fsdp._common_utils import _FSDPState

    for root, state_ref in list(table.items()):
        state = state_ref()
        if state is None or not any(m is module for m in root.modules()):
            continue
        return FSDP1 if isinstance(state, _FSDPState) else FSDP2
    if isinstance(module, _FSDPState) or any(getattr(p, "_fsdp_flattened", False) for p in module.parameters()):
        return FSDP1
    return None


# -- what the launch says, before any model exists (apply()'s report, the doctor) --------------------------------
def expected_from_environment(environ: dict | None = None) -> tuple[str, str]:
    """(engine, evidence) as the launcher or Trainer set it up: accelerate's and the Trainer's variables, an alive
    HfDeepSpeedConfig, or WORLD_SIZE for plain DDP."""
    env = os.environ if environ is None else environ
    if deepspeed_zero3():
        return DEEPSPEED, "transformers HfDeepSpeedConfig with ZeRO stage 3"
    if _truthy(env.get("ACCELERATE_USE_DEEPSPEED")):
        return _accelerate_deepspeed(env)
    if _truthy(env.get("ACCELERATE_USE_FSDP")):
        version = str(env.get("FSDP_VERSION", "1")).strip()
        return (FSDP2 if version == "2" else FSDP1), f"ACCELERATE_USE_FSDP, FSDP_VERSION={version}"
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        return DDP, f"WORLD_SIZE={world} without FSDP or DeepSpeed variables"
    return NONE, "single process"


def _accelerate_deepspeed(env) -> tuple[str, str]:
    """The stage ``accelerate launch`` passes: ACCELERATE_DEEPSPEED_ZERO_STAGE, else its config file's."""
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None and str(stage).strip().isdigit():
        return _of_stage(int(stage)), f"ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE={stage}"
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    found = zero.stage_of_config(path) if path else None
    if found is not None:
        return _of_stage(found), f"ACCELERATE_USE_DEEPSPEED, ZeRO stage {found} in {path}"
    return DEEPSPEED, "ACCELERATE_USE_DEEPSPEED"


def expected_from_args(args: Any) -> tuple[str, str] | None:
    """(engine, evidence) from TrainingArguments/SFTConfig, which hand FSDP and DeepSpeed to accelerate as plugin
    objects rather than variables; None when they ask for neither."""
    if args is None:
        return None
    if getattr(args, "deepspeed", None):
        stage = zero.stage_of_config(args.deepspeed)
        return _of_stage(stage), "TrainingArguments.deepspeed" + (f", ZeRO stage {stage}" if stage is not None else "")
    if getattr(args, "fsdp", None):
        config = getattr(args, "fsdp_config", None) or {}
        version = str(config.get("fsdp_version", config.get("version", 1)))
        return (FSDP2 if version == "2" else FSDP1), f"TrainingArguments.fsdp, fsdp_version={version}"
    return None


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def summary(environ: dict | None = None, args: Any = None) -> str:
    """One line: the expected engine (from ``args`` if they name one, else the environment), and which patches
    act under it."""
    engine, evidence = expected_from_args(args) or expected_from_environment(environ)
    if engine == NONE:
        return "engine: no engine (single process: nothing acts)"
    acting = [p for p, under in ACTS_UNDER.items() if engine in under]
    aside = [p for p, under in ACTS_UNDER.items() if engine not in under]
    return (f"engine: {engine} ({evidence}); acts: {', '.join(acting) or 'nothing'}"
            + (f"; steps aside: {', '.join(aside)}" if aside else ""))


# -- the compile notice ----------------------------------------------------------------------------------------
class _CompileNotice:
    """A dynamo compile-start callback: the one WARNING line for everything that steps aside under compile
    (code traced by dynamo cannot log without breaking the graph, so the patches are silent there)."""

    def __init__(self) -> None:
        from torch._dynamo.callback import callback_handler

        self._handler = callback_handler
        callback_handler.register_start_callback(self)

    def __call__(self, *args: Any) -> None:
        from ..distributed import is_distributed

        if is_distributed():
            log_rank0_once("engine-compile", logging.WARNING,
                           "ddp_patches: torch.compile is compiling code of this process: inside compiled code the "
                           "checkpoint swap and activation offload are not reached (dynamo traces checkpoints as "
                           "its own operator) and the tiled MLP and the unused-parameter rescue step aside; code "
                           "outside compiled regions is patched as usual "
                           "(NOTE [Engines] in ddp_patches/engines/__init__.py)")

    def remove(self) -> None:
        if self in self._handler.start_callbacks:
            self._handler.remove_start_callback(self)


# NOTE [Compile notice armed lazily]
# Invariant: apply() in a launched process without a process group (a DataLoader worker inherits WORLD_SIZE, and
# the runner applies in each) does not import dynamo, which registering the notice does (seconds of start-up).
# Rule: the notice is registered at apply() only where dynamo is already imported or a process group already
# exists; otherwise the first patch that finds the process distributed registers it
# (distributed.on_first_distributed).
# Test: tests/test_api.py::test_apply_in_a_launched_process_without_a_group_does_not_import_dynamo.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §14
def install_compile_notice() -> None:
    """Register the compile notice now where it can matter, else when the process first turns out distributed."""
    from .. import distributed

    if "torch._dynamo" in sys.modules or distributed.is_distributed():
        _register_notice()
    elif int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        distributed.on_first_distributed(_register_notice)


def _register_notice() -> None:
    from .._registry import REGISTRY

    REGISTRY.add_handle(_CompileNotice())
