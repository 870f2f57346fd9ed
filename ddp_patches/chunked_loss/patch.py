"""The chunked loss's patches: the patched causal-LM ``forward``, discovery by structure, install and revert.

``install()`` patches ``PreTrainedModel.__init__`` (to find, by structure, the classes of the models built later)
and the ``forward`` of the causal-LM classes already imported (NOTE [Causal LMs found by structure]). A call that
acts runs the model's own forward with its ``lm_head`` deferred (``deferred._Call``); the returned ``logits`` is
None. ``note_fused(model)`` says where another library replaced the forward.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from typing import Callable

import torch

from .. import engines
from .._after_import import imported_subclasses
from .._registry import REGISTRY
from ..distributed import log_rank0_once
from .deferred import _Call, _Touched
from .function import _counts, _settings
from .rules import _SEE, _note_loss_outside, _step_aside, _why_not

logger = logging.getLogger("ddp_patches")

_verdicts: dict[type, str] = {}  # class -> why its forward runs unchunked (it used the logits: NOTE [Deferred logits])


def _make_forward(original_forward: Callable) -> Callable:
    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        head = (vars(self).get("_modules") or {}).get("lm_head")
        if labels is None and self.training and head is not None and torch.is_grad_enabled() \
                and not engines.compiling():
            _note_loss_outside()
        if labels is None or not self.training or not torch.is_grad_enabled() or head is None \
                or _settings["unchunked"] or engines.compiling() or _verdicts.get(type(self)) is not None:
            return original_forward(self, *args, **kwargs)
        aside = _why_not(self)
        if aside is not None:
            key, level, why = aside
            if why:
                _step_aside(key, level, why)
            return original_forward(self, *args, **kwargs)
        return _run_chunked(self, head, original_forward, args, kwargs)

    return forward


def _run_chunked(model, head, original_forward, args, kwargs):
    call = _Call(model, head, tuple(p for p in head.parameters() if p.requires_grad))
    call.original_loss = model.loss_function
    device = next(model.parameters()).device
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    had_loss = vars(model).get("_loss_function", _MISSING)
    head.forward = call.deferred_head
    model._loss_function = call.loss
    try:
        output = original_forward(model, *args, **kwargs)
    except _Touched as touched:
        why = f"{type(model).__qualname__}'s forward uses the logits other than as the loss's input ({touched})"
        _verdicts[type(model)] = why
        _step_aside(f"touched-{type(model).__qualname__}", logging.WARNING, why)
        output = None
    finally:
        del head.forward
        if had_loss is _MISSING:
            vars(model).pop("_loss_function", None)
        else:
            model._loss_function = had_loss
    if output is None:
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        return original_forward(model, *args, **kwargs)
    if call.used:
        log_rank0_once("chunked-acts", logging.INFO, "ddp_patches: chunked loss: %s computes its training loss in "
                       "chunks of tokens; its output's logits are None in those calls (%s)", type(model).__qualname__,
                       _SEE)
    elif call.placeholder is None:
        _step_aside(f"fused-{type(model).__qualname__}", logging.INFO,
                    f"{type(model).__qualname__}'s forward computed its output without calling lm_head (a fused "
                    "head, such as Liger's fused linear cross entropy, already avoids the full logits)")
    return call.finish(output)


def note_fused(model: torch.nn.Module) -> None:
    """One INFO line for each model whose forward another library replaced on the instance (TRL's fused LM head
    for SFT and DPO, Liger's): its training loss never reaches the patched forward
    (NOTE [When the chunked loss acts]). Called when DDP wraps a module; a no-op unless apply(chunked_loss=True)."""
    if not enabled():
        return
    for m in model.modules():
        forward = vars(m).get("forward")
        if forward is None or "lm_head" not in (vars(m).get("_modules") or {}):
            continue
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)  # its own, not functools.wraps'
        where = "?" if code is None else \
            f"{code.co_filename.replace(os.sep, '/').rsplit('site-packages/', 1)[-1]}:{code.co_name}"
        _step_aside(f"instance-{type(m).__qualname__}-{where}", logging.INFO,
                    f"{type(m).__qualname__}'s forward is replaced on the instance by {where} (TRL's fused LM head "
                    "and Liger compute the loss in chunks themselves); the model's own forward is not reached")


def enabled() -> bool:
    """apply(chunked_loss=True) is in effect."""
    if sys.modules.get("transformers") is None:
        return False
    from transformers import PreTrainedModel

    return REGISTRY.is_patched(PreTrainedModel, "__init__")


_MISSING = object()


# NOTE [Causal LMs found by structure]
# Invariant: no family list. A class is patched if its forward (unwrapped) takes ``labels`` and calls both
# ``self.lm_head`` and ``self.loss_function``: transformers' *ForCausalLM and the *ForConditionalGeneration VLMs.
# Rule: candidates are found at apply() among the PreTrainedModel classes already imported, and at each
# PreTrainedModel.__init__ for the class being built; the instance must hold ``lm_head`` as its own child at call
# time (PEFT's wrappers reach the model's forward, which is patched, through their own).
# Test: tests/test_chunked_loss.py::test_vlm_language_model_chunks.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.2
def _is_candidate_class(cls: type) -> bool:
    owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
    if owner is None or owner is torch.nn.Module:
        return False
    function = inspect.unwrap(vars(owner)["forward"])
    code = getattr(function, "__code__", None)
    if code is None or "lm_head" not in code.co_names or "loss_function" not in code.co_names:
        return False
    try:
        return "labels" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _patch_class(cls: type) -> bool:
    owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
    if owner is None or REGISTRY.is_patched(owner, "forward") or not _is_candidate_class(cls):
        return False
    REGISTRY.install(owner, "forward", _make_forward)
    return True


def _discover_at_init(original_init: Callable) -> Callable:
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        cls = type(self)
        if cls not in _seen:
            _seen.add(cls)
            if _patch_class(cls):
                log_rank0_once("chunked-found-" + cls.__qualname__, logging.INFO,
                               "ddp_patches: chunked loss: %s.%s found (lm_head + loss_function)", cls.__module__,
                               cls.__qualname__)

    return __init__


_seen: set[type] = set()


def forget() -> None:
    _verdicts.clear()
    _seen.clear()
    _counts.update(chunked_calls=0, chunks=0)


REGISTRY.on_reset(forget)


def install() -> list[str]:
    """Patch the causal-LM classes imported so far, and find the rest as models are built."""
    try:
        from transformers import PreTrainedModel
    except ImportError as exc:
        raise ImportError(
            "ddp_patches: apply(chunked_loss=True) computes the loss of transformers causal LMs, and needs "
            f"transformers (importing it failed: {exc}). Install it (pip install 'ddp_patches[hf]', or "
            "transformers>=4.46), or leave chunked_loss off") from exc
    forget()
    REGISTRY.install(PreTrainedModel, "__init__", _discover_at_init)
    found = imported_subclasses(PreTrainedModel, _is_candidate_class)
    patched = [f"{c.__module__}.{c.__qualname__}" for c in found if _patch_class(c)]
    logger.debug("ddp_patches: chunked loss patched %d causal-LM classes already imported", len(patched))
    return ["transformers.PreTrainedModel.__init__ (chunked-loss discovery)"] + \
        [f"{name}.forward" for name in sorted(patched)]
