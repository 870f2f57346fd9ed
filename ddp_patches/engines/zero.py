"""Which modules a DeepSpeed engine runs, and with which ZeRO stage (read from the live engine at call time)."""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import weakref
from typing import Any, Callable

from torch import nn

from .._after_import import when_imported
from .._registry import REGISTRY

logger = logging.getLogger("ddp_patches")

ENGINE_MODULE = "deepspeed.runtime.engine"
TARGETS = (f"{ENGINE_MODULE}.DeepSpeedEngine.__init__", f"{ENGINE_MODULE}.DeepSpeedEngine.forward")

# NOTE [Reentrant checkpoints under ZeRO-1/2]
# Invariant: under DeepSpeed ZeRO-1/2 a weight used in two checkpointed regions is reduced once per backward.
# ZeRO stage 2, and stage 1 with overlap_comm, reduce a parameter's gradient from a hook after its AccumulateGrad
# node and assert that this happens once per backward ("has already been reduced ... Gradient computed twice for
# this partition"); a reentrant checkpoint runs its region's backward as a separate graph task, so a weight in two
# reentrant regions has its AccumulateGrad run once per region. Non-reentrant sums both uses' gradients first.
# Rule: the checkpoint swap acts under stages 1 and 2 (one rule per stage: stage 1 without overlap_comm trains
# either way). Stage 3 keeps reentrant checkpoints (NOTE [Engines]); stage 0 averages after backward with no
# per-parameter hook, so the user's choice is kept. DeepSpeed marks no running forward, so the modules an engine
# runs are recorded at its construction (patched when deepspeed.runtime.engine is imported), its forward marks it
# as running (a checkpointed closure names no module), and the stage is read from the live engine.
# Test: tests/test_zero.py::test_a_weight_in_two_reentrant_checkpoints_trains_under_zero.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §15
_owner: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def own(engine: Any) -> None:
    """Record the modules ``engine`` (a DeepSpeedEngine) runs."""
    module = getattr(engine, "module", None)
    if not isinstance(module, nn.Module):
        logger.info("ddp_patches: a DeepSpeedEngine without a module attribute; its modules are not recorded")
        return
    ref = weakref.ref(engine)
    for m in module.modules():
        _owner[m] = ref
    for callback in _on_built:
        callback(module)  # apply(tiled_mlp=True): its MLPs are found here, as at DDP construction


_running: list[weakref.ref] = []  # engines whose forward is running now, innermost last


def stage_of(module: nn.Module | None) -> int | None:
    """The ZeRO stage of the live DeepSpeed engine that runs ``module`` (recorded at the engine's construction),
    else of the engine whose forward is running (a checkpointed closure has no module); None when neither."""
    ref = _owner.get(module) if module is not None else None
    engine = ref() if ref is not None else None
    if engine is None and _running:
        engine = _running[-1]()
    if engine is None:
        return None
    try:
        return int(engine.zero_optimization_stage())
    except (AttributeError, TypeError, ValueError):
        return None


def stage_of_config(config: Any) -> int | None:
    """``zero_optimization.stage`` of a DeepSpeed config given as a dict, a JSON file path, a JSON string or
    base64-encoded JSON (what transformers' HfDeepSpeedConfig accepts); None where it cannot be read."""
    config = _config_dict(config)
    if not isinstance(config, dict):
        return None
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, (int, str)) or not str(stage).strip().isdigit():
        return None  # "auto", a typo: DeepSpeed itself decides
    return int(stage)


def _config_dict(config: Any) -> Any:
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if not isinstance(config, str):
        return config
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None
    for decode in (lambda text: text, lambda text: base64.urlsafe_b64decode(text).decode()):
        try:
            return json.loads(decode(config))
        except (ValueError, UnicodeDecodeError):
            continue
    return None


def _owning_init(original_init):
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        own(self)

    return __init__


def _marking_forward(original_forward):
    """The engine is marked as running for the length of its forward, as DDP marks its own
    (``_active_ddp_module``): a checkpointed closure inside it, which names no module, is the engine's too."""

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        _running.append(weakref.ref(self))
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            _running.pop()

    return forward


def _patch_engine_init() -> None:
    import importlib

    engine_module = importlib.import_module(ENGINE_MODULE)  # already imported: a dictionary lookup
    cls = getattr(engine_module, "DeepSpeedEngine", None)
    if cls is None:
        logger.warning("ddp_patches: %s has no DeepSpeedEngine in this deepspeed version; the patches treat "
                       "DeepSpeed ZeRO-1/2 models as outside any engine (they step aside there)", ENGINE_MODULE)
        return
    REGISTRY.install(cls, "__init__", _owning_init)
    REGISTRY.install(cls, "forward", _marking_forward)


_on_built: list[Callable[[nn.Module], None]] = []  # what apply() asks to run on each engine's module


def install(on_built: tuple[Callable[[nn.Module], None], ...] = ()) -> list[str]:
    """Record every DeepSpeed engine built from now on: patch its constructor now if deepspeed is imported, else
    right after it is (nothing is imported here); run each of ``on_built`` on the module of every such engine."""
    _on_built[:] = on_built
    REGISTRY.add_handle(_Forget())
    finder = when_imported(ENGINE_MODULE, _patch_engine_init)
    if finder is not None:
        REGISTRY.add_handle(finder)
        return []
    return list(TARGETS)


class _Forget:
    """A registry handle: revert() drops the callbacks with the patches."""

    def remove(self) -> None:
        _on_built.clear()
