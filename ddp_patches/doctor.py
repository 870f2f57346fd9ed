"""``python -m ddp_patches doctor``: what would fail under DDP, why, and what to do -- before a run is launched.

``diagnose(model, args)`` looks at a model (PEFT or not) and its TrainingArguments/SFTConfig (or a Lightning
``Trainer``); the command line
looks at the environment only. Each finding names the setting, the error it leads to under DDP and the fix.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import api, checkpointing, engines, versions
from .distributed import env_int

_PACKAGES = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes")
_TOWER = re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision_encoder|image_encoder)(\.|$)")

MRO = "Expected to mark a variable ready only once ... marked as ready twice"
EAH = "expect_autograd_hooks_ INTERNAL ASSERT FAILED (reducer.cpp)"
UNFINISHED = ("Expected to have finished reduction in the prior iteration before starting a new one "
              "(a hang with NCCL)")


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str  # "error": the run fails under DDP without a fix; "warning": it misbehaves; "info"
    setting: str
    failure: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.severity}] {self.code}: {self.setting}\n    fails with: {self.failure}\n    fix: {self.fix}"


@dataclass
class Diagnosis:
    versions: dict
    world_size: int
    backend: str
    applied: bool
    would_change: list[str]
    findings: list[Finding] = field(default_factory=list)
    engine: str = ""  # ddp_patches.engines.summary(): the expected engine and what acts under it

    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = ["ddp_patches doctor", "versions: " + ", ".join(f"{k} {v or 'not installed'}"
                                                                for k, v in self.versions.items()),
                 f"world size {self.world_size}, backend {self.backend}, ddp_patches applied: {self.applied}",
                 self.engine,
                 "apply() would change (each only while world size > 1):"]
        lines += [f"  - {c}" for c in self.would_change]
        lines.append(f"findings: {len(self.findings) or 'none'}")
        lines += [str(f) for f in self.findings]
        return "\n".join(lines)


LAUNCH_VARIABLES = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_WORLD_SIZE": 1, "LOCAL_RANK": 0}  # name -> least value


def check_launch_environment(environ: dict | None = None) -> None:
    """The launcher's variables are whole numbers where set (torch.distributed and the Trainer refuse anything
    else); a ValueError naming the first that is not."""
    for name, least in LAUNCH_VARIABLES.items():
        env_int(name, least, minimum=least, environ=environ)


def installed_versions() -> dict:
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def would_change(tiled_mlp: bool = False, offload: bool = False) -> list[str]:
    changes = [
        "torch.utils.checkpoint.CheckpointFunction: reentrant checkpoints inside a DDP forward run as "
        "use_reentrant=False",
        "DistributedDataParallel.__init__: settings kept as given; with find_unused_parameters=False or static_graph, "
        "a trainable parameter a forward's outputs cannot reach gets a zero-gradient edge",
        "DistributedDataParallel.no_sync: the first static-graph backward is synchronised",
        "each DDP forward: raises if the trainable parameter set changed after wrapping",
        "torch.distributed.destroy_process_group: first releases the reducers of DDPs built on that group",
        "torch.optim global step hooks (ddp_patches.guard, DDP only): before a step that would apply gradients DDP "
        "never averaged (a loss through `.module` / an unwrapped model) one WARNING on every rank "
        "(apply(on_unsynced='raise') raises); before steps 1 and 2 and every replica_check_every-th (100), each "
        "rank compares a fingerprint of its trainable parameters with rank 0's through the rendezvous store and "
        "logs an ERROR naming the first differing parameter (never a collective, never a hang)",
        "each patch acts only under the engines it is proven for (checkpoint swap and reducer: DDP; offload and "
        "tiled MLP: DDP and FSDP2) and steps aside elsewhere with one WARNING line",
    ]
    if offload:
        changes.append("non-reentrant checkpoints: inputs offloaded to pinned host memory (CUDA only, torch >= 2.8)")
    else:
        changes.append("offload of checkpoint inputs: off (opt-in: apply(offload=True); docs/options.md)")
    if tiled_mlp:
        changes.append("gate/up/down MLPs (found by structure, any family): tiled along the tokens from 2 x hidden "
                       "tokens per call on, in shards decided by bytes")
    return changes


def diagnose(model: Any = None, args: Any = None, *, tiled_mlp: bool = False) -> Diagnosis:
    """Findings for ``model`` (optional) trained with ``args`` (TrainingArguments/SFTConfig or a Lightning
    ``Trainer``, optional)."""
    world = env_int("WORLD_SIZE", 1, minimum=1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    found = installed_versions()
    d = Diagnosis(found, world, "nccl" if torch.cuda.is_available() else "gloo", api.is_applied(),
                  would_change(tiled_mlp), engine=engines.summary(args=args))
    d.findings += _version_findings(found)
    d.findings += _launch_findings(world, args)
    d.findings += _engine_findings(args)
    d.findings += _checkpoint_findings(model, args)
    d.findings += _reducer_findings(model, args)
    d.findings += _lightning_findings(args)
    d.findings += _unwrapped_loss_findings(args)
    return d


def _unwrapped_loss_findings(args: Any) -> list[Finding]:
    """A trainer configuration known to compute the loss on the unwrapped model (trl#7245: DPO/KTO with Liger)."""
    if args is None or not getattr(args, "use_liger_kernel", False):
        return []
    kind = type(args).__name__
    if not any(name in kind for name in ("DPO", "KTO")):
        return []
    return [Finding(
        "unwrapped-loss", "warning", f"{kind}(use_liger_kernel=True)",
        "no error: reported to compute the loss on the unwrapped model (trl#7245), so DDP never averages the "
        "gradients and the ranks drift apart; under ddp_patches.apply() the guard says so at the first optimizer "
        "step, on every rank",
        "use_liger_kernel=False, or a TRL version that routes the Liger loss through the DDP wrapper; "
        "ddp_patches.apply(on_unsynced='raise') stops such a run at its first step")]


def _version_findings(found: dict) -> list[Finding]:
    try:
        versions.check({"torch": found["torch"], "transformers": found["transformers"]})
    except versions.UnsupportedVersionError as e:
        return [Finding("unsupported-version", "error", "library versions", str(e), "upgrade as the message says")]
    reason = versions.offload_unsupported_reason(found["torch"])
    if reason:
        return [Finding("offload-needs-newer-torch", "info", f"torch {found['torch']}", reason,
                        "upgrade torch to use offload; nothing else depends on it")]
    return []


def _launch_findings(world: int, args: Any) -> list[Finding]:
    found = []
    if world > 1 and args is not None and not torch.cuda.is_available() and not getattr(args, "use_cpu", False):
        found.append(Finding(
            "cpu-launch-without-use-cpu", "error", f"torchrun with {world} processes on a host without CUDA, "
            "use_cpu=False", "no error: every rank silently trains alone, no gradient is synchronised",
            "pass use_cpu=True in TrainingArguments/SFTConfig (DDP over gloo)"))
    if world > 1 and not api.is_applied():
        found.append(Finding(
            "not-applied", "warning", "distributed launch without ddp_patches.apply()",
            "the errors below, depending on the settings", "call ddp_patches.apply() before building the Trainer"))
    return found


def _engine_findings(args: Any) -> list[Finding]:
    expected = engines.expected_from_args(args)
    if expected is None:
        return []
    engine, evidence = expected
    if engine in (engines.FSDP1, engines.FSDP2) and not torch.cuda.is_available():
        return [Finding(
            "fsdp-on-cpu-host", "warning", f"{evidence} on a host without CUDA",
            "no error: accelerate keeps DistributedType.MULTI_CPU and trains with DDP, not FSDP",
            "shard with torch.distributed.fsdp.fully_shard yourself, or run FSDP on GPUs")]
    if engine == engines.DEEPSPEED:
        return [Finding(
            "deepspeed-steps-aside", "info", evidence,
            "nothing fails; the checkpoint swap, offload and tiled MLP step aside under DeepSpeed ZeRO-3",
            "nothing to do: DeepSpeed does not use DDP's reducer")]
    if engine == engines.ZERO12:
        return [Finding(
            "deepspeed-zero12", "info", evidence,
            "a weight used in two reentrant checkpoints (a shared block, two forwards before one backward) fails with "
            "'has already been reduced' under ZeRO-2 and ZeRO-1 with overlap_comm",
            "ddp_patches.apply(): the checkpoint swap, offload and tiled MLP act under ZeRO-1/2 "
            "(NOTE [Reentrant checkpoints under ZeRO-1/2] in ddp_patches/engines/zero.py)")]
    return []


def _checkpoint_findings(model: Any, args: Any) -> list[Finding]:
    found = []
    reentrant = _uses_reentrant(model, args)
    find_unused = _find_unused(model, args)
    if reentrant and find_unused is not False:
        why = "ddp_find_unused_parameters unset -> True for a PeftModel" if find_unused is None else \
            "ddp_find_unused_parameters=True"
        found.append(Finding(
            "reentrant-find-unused", "error", f"reentrant activation checkpointing with {why}", MRO,
            "ddp_patches.apply() (runs reentrant checkpoints as non-reentrant under DDP), or "
            "gradient_checkpointing_kwargs={'use_reentrant': False}"))
    elif reentrant:
        found.append(Finding(
            "reentrant-checkpoint", "warning", "reentrant activation checkpointing (use_reentrant=True or {} kwargs)",
            MRO + " for a layer or weight used in two checkpointed regions; no LoRA gradients for a region whose "
            "input does not require grad", "ddp_patches.apply(), or use_reentrant=False"))
    if model is not None and _transformers_offload(model):
        found.append(_transformers_offload_finding(reentrant))
    return found


def _transformers_offload_finding(reentrant: bool) -> Finding:
    """transformers' offload=True: fails on a CPU host; elsewhere it is the one offload that acts on its
    checkpoints (NOTE [One offload at a time] in ddp_patches/offload/offloader.py)."""
    if not torch.cuda.is_available():
        return Finding(
            "transformers-offload-on-cpu-host", "error", "activation_checkpointing_enable(offload=True) on a host "
            "without CUDA", "RuntimeError: pin_memory=True requires a CUDA or other accelerator backend",
            "drop offload=True; ddp_patches.apply(offload=True) offloads checkpoint inputs itself where a GPU exists")
    report = api.current_report()
    ours = bool(report and report.options.get("offload"))
    swap = " The checkpoint swap runs inside it and keeps it." if reentrant and report else ""
    return Finding(
        "transformers-offload", "info", "activation_checkpointing_enable(offload=True)"
        + (" with ddp_patches.apply(offload=True)" if ours else ""),
        "no error: transformers' save_on_cpu moves each checkpoint's inputs to host memory"
        + ("; this library's offload steps aside for those checkpoints (no tensor is copied twice)" if ours else "")
        + "." + swap,
        "nothing, or drop offload=True from activation_checkpointing_enable and use ddp_patches.apply(offload=True), "
        "whose copies overlap compute (docs/options.md, 'offload')")


def _reducer_findings(model: Any, args: Any) -> list[Finding]:
    found = []
    if args is None:
        return found
    static = bool(getattr(args, "ddp_static_graph", False))
    accum = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    if static and accum > 1:
        found.append(Finding(
            "static-graph-accumulation", "error", f"ddp_static_graph=True with gradient_accumulation_steps={accum}",
            EAH, "ddp_patches.apply() (synchronises the first backward), or drop ddp_static_graph"))
    tower = _trainable_tower_parameters(model)
    if tower and getattr(args, "ddp_find_unused_parameters", None) is False and not static and not api.is_applied():
        found.append(Finding(
            "tower-lora-find-unused-false", "error", f"{len(tower)} trainable vision-tower parameters (e.g. "
            f"{tower[0]}) with ddp_find_unused_parameters=False: a text-only batch leaves them without gradient",
            UNFINISHED, "ddp_patches.apply() (a text-only rank gives them a zero-gradient edge; the setting is "
            "kept), or ddp_find_unused_parameters=True"))
    return found


def _lightning_findings(args: Any) -> list[Finding]:
    """A Lightning ``Trainer`` (read without importing Lightning): its DDPStrategy keeps DDP's keywords in
    ``_ddp_kwargs``, and accumulation puts the first micro-steps in ``no_sync()`` (casanovo#512)."""
    ddp_kwargs = getattr(getattr(args, "strategy", None), "_ddp_kwargs", None)
    accum = getattr(args, "accumulate_grad_batches", 1)
    if not isinstance(ddp_kwargs, dict) or not ddp_kwargs.get("static_graph") or not isinstance(accum, int) \
            or accum <= 1:
        return []
    return [Finding(
        "lightning-static-graph-accumulation", "error",
        f"Lightning DDPStrategy(static_graph=True) with accumulate_grad_batches={accum}", EAH,
        "ddp_patches.apply() at the top of the script (it reaches the ranks Lightning starts; it synchronises the "
        "first backward), or DDPStrategy(static_graph=False)")]


def _uses_reentrant(model: Any, args: Any) -> bool:
    """Reentrant when the layers' checkpoint partial says so, or the training args will enable it that way."""
    for func in checkpointing.gradient_checkpointing_funcs(model):
        keywords = getattr(func, "keywords", {}) or {}
        if keywords.get("use_reentrant", True):  # torch's default (no keyword) is reentrant
            return True
    if args is not None and getattr(args, "gradient_checkpointing", False):
        kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
        if kwargs is not None and kwargs.get("use_reentrant", True):
            return True
    return False


def _transformers_offload(model: Any) -> bool:
    for func in checkpointing.gradient_checkpointing_funcs(model):
        inner = getattr(func, "func", func)
        if "save_on_cpu" in getattr(getattr(inner, "__code__", None), "co_names", ()):
            return True
    return False


def _find_unused(model: Any, args: Any) -> bool | None:
    """True/False as the Trainer will pass it; None when unset and the model is not a PreTrainedModel (the
    Trainer then passes True); False when unset for a PreTrainedModel."""
    if args is None:
        return None
    value = getattr(args, "ddp_find_unused_parameters", None)
    if value is not None:
        return value
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return False if isinstance(model, PreTrainedModel) else None


def _trainable_tower_parameters(model: Any) -> list[str]:
    if model is None:
        return []
    return [n for n, p in model.named_parameters() if p.requires_grad and _TOWER.search(n)]
