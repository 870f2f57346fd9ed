"""The tiled MLP's patches: the patched ``forward``, discovery by structure, install and revert.

``install(shard_tokens=...)`` patches the ``forward`` of the gate/up/down MLP classes imported so far and installs
the hook that finds the rest as transformers models are built (``discover(model)``, also run when DDP wraps a
module; NOTE [MLPs found by structure]). Under DDP, FSDP2 or DeepSpeed ZeRO-1/2 with grad enabled, a patched
forward runs the call through ``apply_tiled`` in the shards the rules give. ``counts()`` says how many calls tiled.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

import torch

from .. import engines
from .._after_import import imported_subclasses
from .._registry import REGISTRY
from ..distributed import is_distributed, log_rank0_once
from .function import apply_tiled
from .rules import (_GATED, cached_parametrization, _hooked, _long_enough, _measured_intermediate, _outside, _plan,
                    _reaches_outside, settings, _structure_problem, _verdict, _verdicts)

logger = logging.getLogger("ddp_patches")

also_discover: list = []  # other tiled patches' discover(model), registered by their install()
_counts = {"tiled_calls": 0, "shards": 0}


def counts() -> dict:
    """How many MLP calls ran tiled, and in how many shards in all, since apply() (for logs and tests)."""
    return dict(_counts)


def _make_tiled_forward(original_forward: Callable) -> Callable:
    def forward(self, *args, **kwargs):  # any call the original accepts passes through; only forward(x) tiles
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or settings["untiled"] \
                or not torch.is_grad_enabled() or not is_distributed() \
                or engines.compiling():  # under dynamo: silent (a log call breaks the graph); NOTE [Engines]
            return original_forward(self, *args, **kwargs)
        x = args[0]
        engine = engines.of_module(self)
        if not engines.acts("tiled_mlp", engine):
            engines.step_aside("tiled_mlp", engine)
            return original_forward(self, x)
        hidden = x.shape[-1]
        rows = x.numel() // hidden if hidden else 0
        params = tuple(p for p in self.parameters() if p.requires_grad)
        if not (params or x.requires_grad) or not _long_enough(rows, hidden) \
                or _hooked(self, params) or cached_parametrization(self) \
                or _verdict(self, x, original_forward) is not None \
                or _reaches_outside(self, x, original_forward):
            return original_forward(self, x)
        sizes = _plan(self, x, rows, hidden)
        if len(sizes) == 1:
            return original_forward(self, x)
        _counts["tiled_calls"] += 1
        _counts["shards"] += len(sizes)
        out = apply_tiled(lambda shard: original_forward(self, shard), sizes, x.reshape(rows, hidden), params,
                          module=self)
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


def _is_candidate_class(cls: type) -> bool:
    """The class's ``__init__`` (its own or inherited) assigns gate_proj, up_proj and down_proj."""
    init = next((vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)), None)
    names = getattr(getattr(init, "__code__", None), "co_names", ())
    return all(n in names for n in _GATED)


def forward_owner(cls: type) -> type | None:
    owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
    return None if owner in (None, torch.nn.Module) else owner


def _patch_class(cls: type) -> bool:
    owner = forward_owner(cls)
    if owner is None or REGISTRY.is_patched(owner, "forward"):
        return False
    REGISTRY.install(owner, "forward", _make_tiled_forward)
    return True


def discover(model: torch.nn.Module) -> list[str]:
    """Patch the forward of every gate/up/down MLP class in ``model`` (an instance check; the probe comes at the
    first call). Called for you when a transformers model is built after apply() and when DDP wraps a module;
    call it yourself for a non-transformers model that FSDP2 shards and that was built before apply()."""
    if not enabled():
        return []
    found = [name for other in also_discover for name in other(model)]  # apply(tiled_attention=True)'s
    if not settings["mlp"]:
        return found
    for cls in {type(m) for m in model.modules() if _structure_problem(m) is None}:
        if _patch_class(cls):
            found.append(f"{cls.__module__}.{cls.__qualname__}")
    if found:
        log_rank0_once("tiled-found-" + ",".join(sorted(found)), logging.INFO,
                       "ddp_patches: tiled MLP: gate/up/down MLP classes found on %s: %s",
                       type(model).__qualname__, ", ".join(sorted(found)))
    return found


def _discover_after_post_init(original_post_init: Callable) -> Callable:
    def post_init(self, *args, **kwargs):
        result = original_post_init(self, *args, **kwargs)
        discover(self)
        return result

    return post_init


def enabled() -> bool:
    """apply(tiled_mlp=True) or apply(tiled_attention=True) is in effect (the discovery hook is installed).

    transformers is optional: where it was never imported, install() (which imports it) has not run, and a
    torch-only process must not need it to build a DDP.
    """
    if sys.modules.get("transformers") is None:
        return False
    from transformers import PreTrainedModel

    return REGISTRY.is_patched(PreTrainedModel, "post_init")


def install(*, shard_tokens: int | None) -> list[str]:
    """Patch the gate/up/down MLP classes imported so far, and discover the rest on models as they are built
    or wrapped (NOTE [MLPs found by structure])."""
    try:
        from transformers import PreTrainedModel  # noqa: F401 - install_discovery() patches it
    except ImportError as exc:
        raise ImportError(
            "ddp_patches: apply(tiled_mlp=True) tiles the MLPs of transformers models, and needs transformers "
            f"(importing it failed: {exc}). Install it (pip install 'ddp_patches[hf]', or transformers>=4.46), or "
            "leave tiled_mlp off; the other patches need no transformers") from exc

    settings["shard_tokens"] = shard_tokens
    settings["mlp"] = True
    _counts.update(tiled_calls=0, shards=0)
    _verdicts.clear()
    _measured_intermediate.clear()
    _outside.clear()
    installed = install_discovery()
    found = imported_subclasses(torch.nn.Module, _is_candidate_class)
    patched = [f"{c.__module__}.{c.__qualname__}" for c in found if _patch_class(c)]
    logger.debug("ddp_patches: tiled MLP patched %d gate/up/down classes already imported", len(patched))
    return installed + [f"{name}.forward" for name in sorted(patched)]


def install_discovery() -> list[str]:
    """The hook that finds tiled classes on each transformers model built (the tiled MLP's and attention's)."""
    from transformers import PreTrainedModel

    if REGISTRY.is_patched(PreTrainedModel, "post_init"):
        return []
    REGISTRY.install(PreTrainedModel, "post_init", _discover_after_post_init)
    return ["transformers.PreTrainedModel.post_init (tiled-MLP discovery)"]


def _forget() -> None:
    settings["mlp"] = False
    also_discover.clear()


REGISTRY.on_reset(_forget)
