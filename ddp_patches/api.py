"""apply() / revert() / patched(): install and remove the patches as one unit."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Iterator

from . import checkpointing as _checkpointing_patch
from . import chunked_loss as _chunked_loss_patch
from . import engines as _engines
from . import options as _options
from .offload import offloader as _offload_patch
from . import probes as _probes
from . import tiled_attention as _tiled_attention_patch
from . import tiled_mlp as _tiled_mlp_patch
from . import versions
from .engines import zero as _zero
from .guard import steps as _guard
from .rescue import built as _built
from .rescue import reducer as _reducer_patch
from .rescue import teardown as _teardown
from ._registry import REGISTRY
from .distributed import log_rank0_once

logger = logging.getLogger("ddp_patches")

@dataclass(frozen=True)
class ApplyReport:
    """What apply() installed, and the options it was called with."""

    installed: tuple[str, ...]
    options: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what was asked for but cannot act here, and why
    engine: str = ""  # the engine the launch sets up, and which patches act under it (ddp_patches.engines)

    def __str__(self) -> str:
        text = "ddp_patches installed: " + (", ".join(self.installed) or "nothing")
        if self.options.get("offload") is False:
            text += "; offload off (opt-in: apply(offload=True); docs/options.md)"
        return text + "".join(f"; {note}" for note in (*self.notes, self.engine) if note)


_state: dict[str, ApplyReport | None] = {"report": None}


# Explicit keywords, for IDEs and readers; their names and defaults are OPTIONS' (tests/test_options.py checks).
def apply(
    *,
    checkpointing: bool = True,
    reducer: bool = True,
    offload: bool | str = False,
    tiled_mlp: bool = False,
    tiled_mlp_shard_tokens: int | None = None,
    tiled_attention: bool = False,
    tiled_attention_shard_tokens: int | None = None,
    chunked_loss: bool = False,
    offload_min_bytes: int = 1 << 20,
    offload_max_pinned_bytes: int | None = None,
    offload_prefetch_depth: int = 1,
    offload_max_in_flight: int = 1,
    on_unsynced: str = "warn",
    replica_check_every: int = 100,
) -> ApplyReport:
    """Install the patches. Call it before building TrainingArguments/Trainer/SFTTrainer or DDP.

    Nothing changes in a process that is not distributed: every patch asks at call time whether a process group
    with world size > 1 exists, and which engine runs the model it acts for (DDP, FSDP2, FSDP1,
    DeepSpeed, torch.compile); it acts only under the engines where it is proven and otherwise steps aside
    with one WARNING line (NOTE [Engines] in ddp_patches/engines/__init__.py; the report names the expected engine).
    Calling apply() again with the same options does nothing; with other options it reverts and re-applies.

    Args:
        checkpointing: run every activation checkpoint as ``use_reentrant=False`` under DDP and DeepSpeed
            ZeRO-1/2 (NOTE [Reentrant checkpoints under ZeRO-1/2] in ddp_patches/engines/zero.py).
        reducer: choose safe DDP settings at construction, make static_graph work with gradient accumulation,
            and check the trainable-parameter set at each forward.
        offload: move the inputs of each non-reentrant checkpoint (a layer's input hidden states) to pinned host
            memory between forward and backward. Opt-in (default False): its CUDA path has run on few GPUs
            (docs/options.md). True does it when distributed and the tensors are on a CUDA device,
            and logs a warning where it cannot act (single process, CPU-only host). "auto", the old default, now
            means False and says so in one WARNING line.
        offload_min_bytes: tensors smaller than this stay on the device (default 1 MiB).
        offload_max_pinned_bytes: per-rank cap of pinned host memory for offload (default None:
            ``options.PINNED_DEFAULT``); beyond it tensors stay on the device.
        offload_prefetch_depth: checkpoint inputs whose copy back starts ahead of backward's need for them (default
            1). Deeper helps where the host-to-device copy of one layer's input takes longer than one layer's
            backward (a slow bus, small layers); each step deeper keeps one more layer input on the device.
        offload_max_in_flight: checkpoint regions whose inputs stay on the device while their copy to the host may
            still run (default 1). Larger helps where the forward outruns the copies (the compute stream then
            waits for them); each region more keeps one more layer input on the device.
        tiled_mlp: under DDP, FSDP2 or DeepSpeed ZeRO-1/2, run every gate/up/down MLP (found by structure on the
            model, any family; NOTE [MLPs found by structure]) tiled along the tokens where it pays, with a backward
            that fires each DDP hook once (NOTEs in ddp_patches/tiled_mlp/).
        tiled_mlp_shard_tokens: at most this many tokens per MLP shard, always tiled; None: the rule by bytes,
            min(ceil(5 x intermediate / hidden), tokens // hidden) shards, untiled below 2
            (NOTE [Tiling by bytes]). Used with ``tiled_mlp``.
        tiled_attention: under DDP, run each decoder layer's input norm, q/k/v and
            o_proj (LoRA included) in token shards around the attention kernel, which sees the whole sequence
            (found by structure; NOTEs in ddp_patches/tiled_attention/). Steps aside under other engines.
        tiled_attention_shard_tokens: at most this many tokens per attention shard, always tiled; None: 4 shards
            where the call has at least 2 x hidden_size tokens (NOTE [Attention tiled by bytes]).
        chunked_loss: in training, a transformers causal LM (found by structure; VLMs and PEFT-wrapped models
            included) called with ``labels`` computes its loss from the final hidden states in chunks of tokens,
            never building the full logits or their float32 copy; its output's ``logits`` is then None. Acts under
            DDP (in one process nothing changes); steps aside with one line wherever the logits are
            read or cannot be matched (NOTE [When the chunked loss acts] in ddp_patches/chunked_loss/rules.py).
        on_unsynced: what to do when an optimizer step is about to apply gradients DDP never averaged (the loss
            went through ``.module`` / an unwrapped model), or when the replica check finds ranks whose
            parameters differ: "warn" (default: one WARNING / ERROR line), "raise", or "off" (no guard; the
            replica check, if on, then only logs). ddp_patches/guard/.
        replica_check_every: compare a fingerprint of the trainable parameters across ranks before the first and
            the second optimizer step and then before every this-many-th (0: never).

    Each keyword's type, bounds and environment variable are declared once, in ``ddp_patches.options.OPTIONS``.
    """
    given = dict(locals())  # the keywords alone: nothing else is bound yet
    # every keyword, by its name: checked against its declaration (ddp_patches/options.py), in apply()'s order
    options = _options.check({name: given[name] for name in _options.BY_NAME})
    if options["offload"] == "auto":
        log_rank0_once("offload-auto", logging.WARNING, "ddp_patches: offload='auto' now means offload=False "
                       "(%s); pass offload=True to turn it on", _offload_patch.WHY_OPT_IN)
        options["offload"] = False
    REGISTRY.settle()  # a runner's deferred apply() comes first: NOTE [A deferred apply() settles first]
    current = _state["report"]
    if current is not None:
        if current.options == options:
            return current
        logger.info("ddp_patches: apply() called again with other options; re-applying")
        _revert(keep_instances=options["reducer"])  # NOTE [Live DDPs stay protected]
    versions.check()

    installed: list[str] = []
    try:
        if options["checkpointing"]:
            installed += _checkpointing_patch.install()
        if options["reducer"]:
            installed += _reducer_patch.install()
        if options["tiled_mlp"]:
            installed += _tiled_mlp_patch.install(shard_tokens=options["tiled_mlp_shard_tokens"])
        if options["tiled_attention"]:
            installed += _tiled_attention_patch.install(shard_tokens=options["tiled_attention_shard_tokens"])
        if options["chunked_loss"]:
            installed += _chunked_loss_patch.install()
        if options["offload"] is not False:
            installed += _offload_patch.install(
                explicit=options["offload"] is True,
                min_bytes=options["offload_min_bytes"],
                max_pinned_bytes=options["offload_max_pinned_bytes"],
                prefetch_depth=options["offload_prefetch_depth"],
                max_in_flight=options["offload_max_in_flight"],
            )
        tiled = options["tiled_mlp"] or options["tiled_attention"]
        if options["checkpointing"] or tiled or options["offload"] is not False:
            on_built = (_tiled_mlp_patch.discover,) if tiled else ()  # it discovers tiled attention too
            installed += _zero.install(on_built)  # which modules a DeepSpeed engine runs (NOTE [Engines])
        guard = _guard.install(on_unsynced=options["on_unsynced"], replica_check_every=options["replica_check_every"])
        # the guard tracks each DDP built, with or without the reducer (NOTE [One owner of DDP.__init__])
        installed += guard + (_built.install(guard_tracking=True) if guard else [])
        _engines.install_compile_notice()
    except BaseException:
        REGISTRY.restore_all()  # all or nothing, and no probe verdict left behind for the next apply()
        raise
    _warn_ignored(options)
    if options["reducer"]:
        _reducer_patch.warn_unprotected()
    notes = [] if options["offload"] is False else [versions.offload_unsupported_reason()]
    notes += [versions.teardown_pause_reason()] if set(_teardown.TARGETS) <= set(installed) else []
    notes += [_probes.note(patch) for patch in ("checkpointing", "reducer", "no_sync", "teardown", "offload")]
    report = ApplyReport(tuple(installed), options, tuple(n for n in notes if n), _engines.summary())
    _state["report"] = report
    log_rank0_once("apply-report", logging.INFO, "%s", report)
    return report


def revert() -> list[str]:
    """Restore every patched object by identity and remove the hooks. Safe to call when nothing is applied.

    DDP instances built while patched keep the settings they were built with, and lose the library's hooks.
    """
    return _revert(keep_instances=False)


# NOTE [Live DDPs stay protected]
# The hooks that protect one DDP instance (the trainable-set guard, the unused-parameter rescue of rescue/edges.py) are
# installed when it is built, once. A re-apply with other options (apply(offload=False) after apply(), or a
# ``patched(...)`` block) reverts and installs the class patches again, but builds no DDP: removing those hooks
# would leave every live DDP unprotected, and its next step would fail ("finished reduction"). So a re-apply that
# keeps reducer=True keeps them; revert() and a re-apply with reducer=False remove them.
# Test: tests/test_api.py::test_reapply_keeps_live_ddps_protected
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §3
def _revert(keep_instances: bool) -> list[str]:
    restored = REGISTRY.restore_all(keep_instances=keep_instances)  # NOTE [Each module forgets its own state]
    _state["report"] = None
    return restored


def is_applied() -> bool:
    return _state["report"] is not None


def current_report() -> ApplyReport | None:
    """The report of the apply() in force, or None."""
    return _state["report"]


@contextlib.contextmanager
def patched(**options) -> Iterator[ApplyReport]:
    """``with ddp_patches.patched(): ...`` applies on entry and, on exit (also on error), reverts -- or, when
    apply() was already in force, goes back to the options it had."""
    previous = _state["report"]
    report = apply(**options)
    try:
        yield report
    finally:
        if previous is None:
            revert()
        else:
            apply(**previous.options)  # the options in force before the block, exactly (a no-op if unchanged)


def _warn_ignored(options: dict) -> None:
    if options["tiled_mlp_shard_tokens"] is not None and not options["tiled_mlp"]:
        logger.warning("ddp_patches: tiled_mlp_shard_tokens=%d is ignored because tiled_mlp=False; pass "
                       "tiled_mlp=True to tile the MLPs", options["tiled_mlp_shard_tokens"])
    if options["tiled_attention_shard_tokens"] is not None and not options["tiled_attention"]:
        logger.warning("ddp_patches: tiled_attention_shard_tokens=%d is ignored because tiled_attention=False; "
                       "pass tiled_attention=True to tile the attention projections",
                       options["tiled_attention_shard_tokens"])
