"""Mechanism 4: Hugging Face gated MLPs run tiled along the token dimension, with a DDP-safe backward.

# NOTE [Why the parameters are inputs of the Function]
# A tiled MLP runs its forward shard by shard under no_grad (so no shard's intermediates are kept) and
# recomputes each shard in backward. How that backward produces parameter gradients decides whether DDP works:
#   * ``.backward()`` per shard: each call is its own graph task, so every parameter's AccumulateGrad hook fires
#     once per shard -> "marked ready twice", or silently wrong gradients under some settings;
#   * ``autograd.grad`` for all shards and ``.backward()`` on the last: the parameters are not reachable from
#     the outer output (the forward ran under no_grad), so find_unused_parameters=True marks them unused first
#     and their later hook is a second mark; a parameter used by an early shard only is never all-reduced.
# Here every trainable parameter the MLP uses (LoRA A/B, DoRA magnitudes, biases, full fine-tune weights) is
# an explicit input of the autograd.Function. Backward takes ``torch.autograd.grad`` per shard with respect
# to the shard input and those parameters -- ``grad`` does not run AccumulateGrad, so no DDP hook fires inside
# -- and returns the summed gradients once. The outer graph then reaches each parameter through this one node
# and its AccumulateGrad (with DDP's hook) runs exactly once per backward, whatever the shard count. That is
# why find_unused True/False, static_graph (one node regardless of a shard count that varies between steps or
# ranks), bucket views and no_sync all hold. A design that returned only dx would give zero LoRA gradients
# whenever the MLP input does not require grad (LoRA only on the MLP, frozen embeddings).
#
# NOTE [Replaying the forward exactly]
# Each shard's recompute runs under the RNG state that shard saw in forward (dropout masks, e.g. LoRA dropout,
# are the same) and under the autocast state of the forward, so the gradients are those of the tensors the
# forward produced. Each shard calls the class's original ``forward``: nothing about the MLP is re-implemented,
# which is why it is exact for every family (gelu or silu, bias or not, PEFT/bnb layers inside).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from typing import Callable

import torch

from . import engines
from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once

logger = logging.getLogger("ddp_patches")

# (family, modeling module, classes tiled). Text MLPs of every listed family; Qwen2-VL and Qwen2.5-VL each have
# their own Qwen2MLP class. Qwen2.5-VL's vision MLP is the same gated shape (with bias) on 2-D inputs: tiled.
TARGETS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Llama (also Llava, Idefics3, SmolVLM text towers)", "transformers.models.llama.modeling_llama", ("LlamaMLP",)),
    ("Mistral", "transformers.models.mistral.modeling_mistral", ("MistralMLP",)),
    ("Qwen2", "transformers.models.qwen2.modeling_qwen2", ("Qwen2MLP",)),
    ("Qwen3", "transformers.models.qwen3.modeling_qwen3", ("Qwen3MLP",)),
    ("Gemma2", "transformers.models.gemma2.modeling_gemma2", ("Gemma2MLP",)),
    ("Gemma3", "transformers.models.gemma3.modeling_gemma3", ("Gemma3MLP",)),
    ("Qwen2-VL", "transformers.models.qwen2_vl.modeling_qwen2_vl", ("Qwen2MLP",)),
    ("Qwen2.5-VL", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", ("Qwen2MLP", "Qwen2_5_VLMLP")),
    ("Qwen3-VL", "transformers.models.qwen3_vl.modeling_qwen3_vl", ("Qwen3VLTextMLP",)),
)
# MLP-like classes of those families left alone on purpose: not a gate/up/down MLP.
NOT_TILED = (
    "Qwen2-VL VisionMlp (fc1/fc2)",
    "Qwen3-VL Qwen3VLVisionMLP (linear_fc1/linear_fc2)",
    "Idefics3/SmolVLM vision MLP (fc1/fc2) and connector (proj)",
    "Llava multi-modal projector (linear_1/linear_2)",
)
_GATED = ("gate_proj", "up_proj", "down_proj")

_settings: dict = {"shard_tokens": None, "untiled": 0}
_counts = {"tiled_calls": 0, "shards": 0}


def counts() -> dict:
    """How many MLP calls ran tiled, and in how many shards in all, since apply() (for logs and tests)."""
    return dict(_counts)


@contextlib.contextmanager
def untiled():
    """Run patched MLPs untiled inside this block (a reference computation, evaluation code)."""
    _settings["untiled"] += 1
    try:
        yield
    finally:
        _settings["untiled"] -= 1


def shard_sizes(rows: int, hidden: int, shard_tokens: int | None) -> list[int]:
    """Rows per shard: at most ``shard_tokens`` each, or, when None, ceil(rows / hidden) shards (the ALST rule:
    one shard's intermediate activations are then no larger than the layer's hidden states). Even split."""
    per = shard_tokens if shard_tokens is not None else max(hidden, 1)
    count = max(1, math.ceil(rows / per))
    base, extra = divmod(rows, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


class TiledMLPFunction(torch.autograd.Function):
    """``out = cat(forward_fn(shard) for shard in x2d.split(rows))`` with the backward of NOTE [Why the
    parameters are inputs of the Function]. ``params`` are exactly the trainable parameters ``forward_fn`` uses.
    """

    @staticmethod
    def forward(ctx, forward_fn: Callable, rows: list[int], x2d: torch.Tensor, *params: torch.Tensor):
        ctx.forward_fn, ctx.rows, ctx.params = forward_fn, rows, params
        ctx.autocast = _autocast_state(x2d.device.type)
        ctx.rng_states = []
        out, start = None, 0
        for shard in x2d.split(rows):
            ctx.rng_states.append(_rng_state(x2d.device))
            y = forward_fn(shard)
            if out is None:  # written in place: no list of shard outputs plus a concatenated copy
                out = y.new_empty((x2d.shape[0], y.shape[-1]))
            out[start:start + shard.shape[0]] = y
            start += shard.shape[0]
        ctx.save_for_backward(x2d)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x2d,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        dx = torch.empty_like(x2d) if want_x else None
        grads: list[torch.Tensor | None] = [None] * len(ctx.params)
        start = 0
        for shard, g_shard, rng in zip(x2d.split(ctx.rows), grad_out.split(ctx.rows), ctx.rng_states):
            shard = shard.detach().requires_grad_(want_x)
            with _replay(x2d.device, rng, ctx.autocast), torch.enable_grad():
                out = ctx.forward_fn(shard)
            inputs = ([shard] if want_x else []) + [ctx.params[i] for i in wanted]
            got = torch.autograd.grad(out, inputs, g_shard, allow_unused=True)
            if want_x:
                dx[start:start + shard.shape[0]] = got[0] if got[0] is not None else 0
                got = got[1:]
            for i, g in zip(wanted, got):
                if g is not None:
                    grads[i] = g if grads[i] is None else grads[i].add_(g)
            start += shard.shape[0]
        for i in wanted:  # a parameter no shard used still gets a gradient: zeros, as the untiled graph's
            if grads[i] is None:
                grads[i] = torch.zeros_like(ctx.params[i])
        return (None, None, dx, *grads)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replay(device: torch.device, rng: tuple, autocast: tuple):
    cpu_state, cuda_state = rng
    devices = [device] if cuda_state is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        device_type, enabled, dtype, cpu_enabled, cpu_dtype = autocast
        device_ctx = torch.autocast(device_type, dtype=dtype, enabled=enabled) if device_type != "cpu" \
            else contextlib.nullcontext()
        with device_ctx, torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu_enabled):
            yield


def _autocast_state(device_type: str) -> tuple:
    enabled = torch.is_autocast_enabled(device_type) if device_type != "cpu" else False
    dtype = torch.get_autocast_dtype(device_type) if device_type != "cpu" else None
    return (device_type, enabled, dtype, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))


def _make_tiled_forward(original_forward: Callable) -> Callable:
    def forward(self, x, *args, **kwargs):
        if args or kwargs or _settings["untiled"] or not torch.is_grad_enabled() or not is_distributed() \
                or engines.compiling():  # under dynamo: silent (a log call breaks the graph); NOTE [Engines]
            return original_forward(self, x, *args, **kwargs)
        engine = engines.of_module(self)
        if not engines.acts("tiled_mlp", engine):
            engines.step_aside("tiled_mlp", engine)
            return original_forward(self, x)
        if not all(hasattr(self, name) for name in _GATED):
            log_rank0_once("tiled-shape-" + type(self).__qualname__, logging.INFO,
                           "ddp_patches: %s has no gate_proj/up_proj/down_proj; it runs untiled",
                           type(self).__qualname__)
            return original_forward(self, x)
        hidden = x.shape[-1]
        rows = x.numel() // hidden if hidden else 0
        sizes = shard_sizes(rows, hidden, _settings["shard_tokens"])
        params = tuple(p for p in self.parameters() if p.requires_grad)
        if len(sizes) == 1 or not (params or x.requires_grad):
            return original_forward(self, x)
        _counts["tiled_calls"] += 1
        _counts["shards"] += len(sizes)
        out = TiledMLPFunction.apply(lambda shard: original_forward(self, shard), sizes,
                                     x.reshape(rows, hidden), *params)
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


def _patch_mlp_class(cls: type) -> None:
    REGISTRY.install(cls, "forward", _make_tiled_forward)


def install(*, shard_tokens: int | None) -> list[str]:
    """Patch the MLP classes of every listed family that this transformers has; log the ones it lacks."""
    _settings["shard_tokens"] = shard_tokens
    _counts.update(tiled_calls=0, shards=0)
    patched, missing = [], []
    for family, module_name, class_names in TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(family)
            continue
        for name in class_names:
            cls = vars(module).get(name)
            if cls is None:
                missing.append(f"{family} {name}")
                continue
            _patch_mlp_class(cls)
            patched.append(f"{module_name}.{name}.forward")
    if missing:
        logger.info("ddp_patches: tiled MLP skips families this transformers lacks: %s", ", ".join(missing))
    logger.info("ddp_patches: tiled MLP leaves other MLP shapes untiled: %s", "; ".join(NOT_TILED))
    return patched
