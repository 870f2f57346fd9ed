"""Mechanism 2: make DDP's reducer safe before the first step.

Three measured failures, three small steps, each only when the process is distributed:

1. ``find_unused_parameters`` (NOTE [find_unused choice]). A trainable parameter that gets no gradient on some
   rank or iteration (LoRA on a vision tower and a text-only batch, an idle MoE expert) makes a reducer built
   with find_unused_parameters=False raise "Expected to have finished reduction in the prior iteration" (gloo)
   or hang (NCCL). Once every checkpoint is non-reentrant (ddp_patches.checkpointing), True is correct in
   every configuration measured, so it is chosen unless the caller passed False to the constructor explicitly.
2. static_graph + gradient accumulation (NOTE [static graph first step]): the first backward under
   ``no_sync()`` trips ``expect_autograd_hooks_ INTERNAL ASSERT FAILED``; the first one is made a synced one.
3. The trainable-parameter set is checked at every training forward against the one the reducer was built
   with (parameters frozen or unfrozen after wrapping): a clear error instead of a hang or silent drift.

Settings and overrides are logged once on rank 0. The library does no dummy forward: DDP installs its
autograd hooks at construction, and a no-grad forward installs nothing, so it would have no measured effect.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Mapping

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once

logger = logging.getLogger("ddp_patches")

TARGETS = ("DistributedDataParallel.__init__", "DistributedDataParallel.no_sync")

# The DDP settings worth reporting in the one log line.
_REPORTED = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb")


class TrainableParametersChangedError(RuntimeError):
    """Raised when parameters were frozen or unfrozen after the model was wrapped in DDP."""


# NOTE [find_unused choice]
# Measured (2 ranks, gloo, fp64): with non-reentrant checkpointing, find_unused_parameters=True passes every
# module/setting we tried, including a parameter that alternates between used and unused; False fails as soon
# as one trainable parameter receives no gradient on one rank. The Trainer derives False for a
# PreTrainedModel with checkpointing and DDP defaults to False, which is exactly the VLM-with-text-only-batch
# hang. So: an explicit constructor argument is respected (False is logged as a risk); anything else becomes
# True. accelerate passes only non-default handler values, so False from a Trainer is not visible as explicit.
# With static_graph=True the reducer finds unused parameters itself in the first iteration and DDP warns if
# find_unused is also set, so it is left alone there. Without the checkpoint swap, True would *cause* "marked
# ready twice" for reentrant regions, so nothing is changed then either.
def choose_ddp_settings(explicit: Mapping[str, Any], *, checkpoint_swap: bool) -> tuple[dict[str, Any], list[str]]:
    """Return (settings to pass to DDP on top of ``explicit``, one reason per override)."""
    changes: dict[str, Any] = {}
    reasons: list[str] = []
    if explicit.get("static_graph"):
        return changes, reasons
    if "find_unused_parameters" in explicit:
        if not explicit["find_unused_parameters"]:
            reasons.append(
                "find_unused_parameters=False kept because it was passed explicitly; a trainable parameter "
                "that gets no gradient on one rank will then raise or hang"
            )
        return changes, reasons
    if checkpoint_swap:
        changes["find_unused_parameters"] = True
        reasons.append(
            "find_unused_parameters False -> True: with non-reentrant checkpointing it is correct for every "
            "graph, and the only setting under which a trainable parameter that gets no gradient on some rank "
            "(vision-tower LoRA with a text-only batch) neither raises nor hangs"
        )
    return changes, reasons


class TrainableGuard:
    """Forward pre-hook on one DDP instance: the trainable set must stay what the reducer was built with."""

    def __init__(self, ddp: DDP) -> None:
        self.expected = _trainable_names(ddp)

    def __call__(self, ddp: DDP, args: Any) -> None:
        if not (ddp.training and torch.is_grad_enabled()):
            return
        current = _trainable_names(ddp)
        if current != self.expected:
            raise TrainableParametersChangedError(_changed_message(self.expected, current))


def _trainable_names(ddp: DDP) -> frozenset[str]:
    ignored = getattr(ddp, "parameters_to_ignore", set())
    return frozenset(n for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored)


def _changed_message(expected: frozenset[str], current: frozenset[str]) -> str:
    added = sorted(current - expected)
    removed = sorted(expected - current)
    lines = ["ddp_patches: the trainable parameters changed after the model was wrapped in DistributedDataParallel."]
    if added:
        lines.append(f"  now trainable, but not when DDP was built (they would never be synchronised): {_some(added)}")
    if removed:
        lines.append(f"  trainable when DDP was built, frozen now (the reducer would wait for them): {_some(removed)}")
    lines.append("  DDP registers its gradient hooks once, at construction. Freeze/unfreeze parameters and add "
                 "adapters before wrapping (before Trainer/SFTTrainer or accelerator.prepare), or build a new "
                 "DistributedDataParallel after the change.")
    return "\n".join(lines)


def _some(names: list[str], shown: int = 8) -> str:
    return f"{names[:shown]}" + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _patched_ddp_init(original_init):
    signature = inspect.signature(original_init)

    def __init__(self, *args, **kwargs):
        if not is_distributed():
            return original_init(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        explicit = {k: v for k, v in bound.arguments.items() if k not in ("self", "module")}
        changes, reasons = choose_ddp_settings(explicit, checkpoint_swap=_checkpoint_swap_active())
        original_init(self, *args, **{**kwargs, **changes})
        REGISTRY.add_handle(self.register_forward_pre_hook(TrainableGuard(self)))
        _log_settings(self, reasons)

    return __init__


def _checkpoint_swap_active() -> bool:
    import torch.utils.checkpoint as torch_checkpoint

    return REGISTRY.is_patched(torch_checkpoint, "CheckpointFunction")


def _log_settings(ddp: DDP, reasons: list[str]) -> None:
    settings = ", ".join(f"{k}={getattr(ddp, k, None)}" for k in _REPORTED if hasattr(ddp, k))
    message = "ddp_patches: DistributedDataParallel built with " + settings
    if reasons:
        message += "".join(f"\n  - {r}" for r in reasons)
    log_rank0_once(f"ddp-settings:{settings}:{reasons}", logging.INFO, message)


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


def install() -> list[str]:
    _patch_ddp_init()
    _patch_ddp_no_sync()
    return list(TARGETS)

