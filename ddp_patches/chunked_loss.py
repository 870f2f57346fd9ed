"""A causal LM's training loss computed from the final hidden states in chunks of tokens (opt-in).

``install()`` patches ``PreTrainedModel.__init__`` (to find, by structure, the classes of the models built later) and
the ``forward`` of the causal-LM classes already imported (NOTE [Causal LMs found by structure]). A call that acts
(NOTE [When the chunked loss acts]) runs the model's own forward with its ``lm_head`` deferred: the head returns a
placeholder, the model's ``loss_function`` receives it, and the loss is computed by ``ChunkedCrossEntropy`` without
the full logits [B, S, V] or their float32 copy (NOTE [One gradient per parameter, computed in forward]). The
returned ``logits`` is None. ``counts()`` says how many calls were chunked.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F

from . import engines
from .rescue.edges import needs_defined_zero
from ._registry import REGISTRY
from .distributed import log_rank0_once

logger = logging.getLogger("ddp_patches")

_settings: dict = {"chunk_rows": None, "unchunked": 0}
# Where it acts: under DDP only, as the tiled MLP (in one process the library changes nothing); other engines step
# aside with one WARNING, a single process silently.
ACTS_UNDER = (engines.DDP,)
_counts = {"chunked_calls": 0, "chunks": 0}
_verdicts: dict[type, str] = {}  # class -> why its forward runs unchunked (it used the logits: NOTE [Deferred logits])
# Config attributes of models whose forward changes the logits between lm_head and the loss (Gemma-2's softcap,
# Cohere's and Granite's scales, ...), as TRL's own fused head reads them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                     "output_multiplier")


def counts() -> dict:
    """How many forwards computed their loss in chunks, and in how many chunks in all, since apply()."""
    return dict(_counts)


@contextlib.contextmanager
def unchunked():
    """Compute the loss as without the library inside this block (a reference computation)."""
    _settings["unchunked"] += 1
    try:
        yield
    finally:
        _settings["unchunked"] -= 1


@contextlib.contextmanager
def chunk_rows(rows: int | None):
    """Inside this block every chunk has at most ``rows`` tokens (None: the rule by shapes, ``chunk_sizes``)."""
    previous, _settings["chunk_rows"] = _settings["chunk_rows"], rows
    try:
        yield
    finally:
        _settings["chunk_rows"] = previous


def chunk_sizes(rows: int, hidden: int, vocab: int, max_rows: int | None = None) -> list[int]:
    """Tokens per chunk, evenly split: at most ``max_rows`` each, or, when None, NOTE [Chunks by shapes]."""
    if max_rows is not None:
        count = max(1, math.ceil(rows / max_rows))
    else:
        count = max(1, min(rows, math.ceil(vocab / max(hidden, 1))))
    base, extra = divmod(rows, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


# NOTE [Chunks by shapes]
# Invariant: one chunk's logits have no more elements than the hidden states of the call, and every rank and step of one
# shape chunks alike (the rule reads only shapes). Rule: ceil(V / H) chunks (Liger's fused linear cross entropy
# takes the same count), each of rows / chunks tokens. For Llama-3.1-8B (H 4096, V 128256): 32 chunks, 2048 tokens
# each at 64K, whose float32 logits are 1.0 GiB against 31.3 GiB for the whole call.
# Test: tests/test_chunked_loss.py::test_chunk_rule_and_peak_bytes.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.2


# NOTE [One gradient per parameter, computed in forward]
# Invariant: the chunked loss gives the gradients of transformers' ForCausalLMLoss, and fires each trainable
# parameter's AccumulateGrad (and DDP hook) once per backward, whatever the chunk count.
# Rule: the forward takes, chunk by chunk, the loss sum and its gradients w.r.t. the hidden chunk and the head's
# trainable parameters (LoRA on lm_head, a trained head) with ``torch.autograd.grad`` (no AccumulateGrad, no
# hook), keeps grad_hidden ([tokens, H], the size of the hidden states) and one summed gradient per parameter,
# and drops the chunk's logits. Every trainable head parameter is an input of the Function, so its backward only
# scales the kept gradients by the incoming one and returns them once: no recompute in backward, one hook each
# (find_unused True/False, static_graph, no_sync and bucket views hold, as for the tiled MLP:
# NOTE [Why the parameters are inputs of the Function]). A second-order backward through it raises.
# Test: tests/test_chunked_loss.py::test_lora_on_lm_head_gradients_and_one_hook_each.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.2
class ChunkedCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(head(h2d[c]).float(), target[c], ignore_index, reduction="sum") for c in chunks)``.
    ``params``: exactly the trainable parameters ``head`` uses."""

    @staticmethod
    def forward(ctx, head: Callable, rows: list[int], target: torch.Tensor, ignore_index: int,
                h2d: torch.Tensor, *params: torch.Tensor):
        want_h = ctx.needs_input_grad[4]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[5:]) if need]
        total = torch.zeros((), dtype=torch.float32, device=h2d.device)
        grad_h = torch.empty_like(h2d) if want_h else None
        grads: list[torch.Tensor | None] = [None] * len(params)
        start = 0
        for size, t in zip(rows, target.split(rows)):
            chunk = h2d[start:start + size].detach().requires_grad_(want_h)
            with torch.enable_grad():
                loss = F.cross_entropy(head(chunk).float(), t, ignore_index=ignore_index, reduction="sum")
                inputs = ([chunk] if want_h else []) + [params[i] for i in wanted]
                got = torch.autograd.grad(loss, inputs, allow_unused=True) if inputs and loss.requires_grad \
                    else [None] * len(inputs)
            total += loss.detach()
            if want_h:
                grad_h[start:start + size] = got[0] if got[0] is not None else 0
                got = got[1:]
            for i, g in zip(wanted, got):
                if g is not None:
                    grads[i] = g if grads[i] is None else grads[i].add_(g)
            start += size
        ctx.grad_h, ctx.grads, ctx.params, ctx.wanted = grad_h, grads, params, wanted
        ctx.no_tokens = (target == ignore_index).all()  # on the device: no host sync
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("ddp_patches: a second-order backward (create_graph=True) through the chunked LM loss "
                               "is not supported: its gradients are computed in forward; run without "
                               "apply(chunked_loss=True) for this model")
        # Out of place: a backward under retain_graph=True may come again and must find the kept gradients intact.
        # No token to learn from (every label ignore_index): the loss is 0/0 and its incoming gradient infinite, yet
        # cross_entropy gives ignored rows a zero gradient whatever comes in; so do these (zeros, not 0 * inf).
        grad_out = torch.where(ctx.no_tokens, torch.zeros_like(grad_out), grad_out)
        grad_h = None if ctx.grad_h is None else ctx.grad_h * grad_out.to(ctx.grad_h.dtype)
        grads = [None if g is None else g * grad_out.to(g.dtype) for g in ctx.grads]
        for i in ctx.wanted:  # a parameter no chunk used: None, or the zero a static-graph DDP needs (tiled_mlp.py)
            if grads[i] is None and needs_defined_zero(ctx.params[i]):
                grads[i] = torch.zeros_like(ctx.params[i])
        return (None, None, None, None, grad_h, *grads)


def chunked_causal_lm_loss(head: Callable, hidden: torch.Tensor, labels: torch.Tensor | None, params: tuple,
                           num_items_in_batch=None, ignore_index: int = -100,
                           shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ForCausalLMLoss on ``head(hidden)``, computed in chunks (NOTE [Chunks by shapes]): labels
    shifted by one (or ``shift_labels`` as given), the sum over the non-ignored tokens divided by
    ``num_items_in_batch``, else their mean."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    h2d = hidden.reshape(-1, hidden.shape[-1])
    if target.shape[0] != h2d.shape[0]:
        raise ValueError(f"ddp_patches: chunked loss: {h2d.shape[0]} hidden rows for {target.shape[0]} labels")
    vocab = _vocab_size(head, h2d)
    rows = chunk_sizes(h2d.shape[0], h2d.shape[-1], vocab, _settings["chunk_rows"])
    _counts["chunked_calls"] += 1
    _counts["chunks"] += len(rows)
    total = ChunkedCrossEntropy.apply(head, rows, target, ignore_index, h2d, *params)
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()  # cross_entropy's "mean" with ignore_index (0/0: nan, as it)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _vocab_size(head: Callable, h2d: torch.Tensor) -> int:
    module = getattr(head, "module", None)
    features = getattr(module, "out_features", None)
    if isinstance(features, int):
        return features
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[0]
    with torch.no_grad():
        return head(h2d[:1]).shape[-1]


class _Head:
    """The lm_head's own forward, without its hooks (there are none: ``_head_problem``), as a callable."""

    def __init__(self, module: torch.nn.Module, forward: Callable) -> None:
        self.module, self._forward = module, forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)


# NOTE [Deferred logits]
# Invariant: the chunked path runs the model's own forward unchanged and is exact, or the logits are computed.
# Rule: during an acting call, lm_head returns a placeholder (a zero-stride tensor of the logits' shape, a
# subclass whose every op except reading its shape, dtype and device raises) and the model's ``loss_function``
# is swapped, on the instance, for one that computes the chunked loss when it receives that placeholder. The
# placeholder in the output becomes None. If the forward does anything else with it (scales, softcaps, slices)
# the class is marked, one WARNING line says why, the RNG is restored and the original forward runs again (once
# per class; the known transforms are read from the config first, and never reach this). If the forward never
# hands it to the loss, the real logits are computed and returned.
# Test: tests/test_chunked_loss.py::test_a_forward_that_edits_the_logits_runs_unchunked.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.2
class _Touched(Exception):
    pass


_METADATA = {"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda", "is_meta", "is_sparse",
             "is_quantized", "names", "is_nested", "grad_fn"}
_METADATA_CALLS = {"size", "dim", "stride", "numel", "is_floating_point", "is_complex", "__len__", "element_size",
                   "get_device", "is_contiguous", "__format__"}


class DeferredLogits(torch.Tensor):
    """The placeholder lm_head returns inside an acting call (NOTE [Deferred logits])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        owner = getattr(getattr(func, "__self__", None), "__name__", None)
        name = getattr(func, "__name__", "")
        if (name == "__get__" and owner in _METADATA) or name in _METADATA_CALLS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise _Touched(owner if name == "__get__" else (name or repr(func)))


def _placeholder(hidden: torch.Tensor, vocab: int) -> DeferredLogits:
    dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
        else hidden.dtype
    base = torch.zeros((), dtype=dtype, device=hidden.device).expand(*hidden.shape[:-1], vocab)
    return torch.Tensor._make_subclass(DeferredLogits, base, False)


class _Call:
    """One acting forward: what the deferred head saw, and the loss computed from it."""

    def __init__(self, model: torch.nn.Module, head_module: torch.nn.Module, params: tuple) -> None:
        self.model, self.params = model, params
        self.head = _Head(head_module, type(head_module).forward.__get__(head_module))
        self.hidden: torch.Tensor | None = None
        self.placeholder: DeferredLogits | None = None
        self.used = False
        self.original_loss: Callable | None = None

    def deferred_head(self, hidden: torch.Tensor, *args, **kwargs):
        if args or kwargs or self.placeholder is not None:
            raise _Touched("lm_head called with more arguments, or twice")
        self.hidden = hidden
        self.placeholder = _placeholder(hidden, _vocab_size(self.head, hidden.reshape(-1, hidden.shape[-1])))
        return self.placeholder

    def loss(self, logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kwargs):
        if logits is not self.placeholder or self.placeholder is None:
            if isinstance(logits, DeferredLogits):
                raise _Touched("loss_function received another tensor derived from the logits")
            return self.original_loss(logits=logits, labels=labels, vocab_size=vocab_size,
                                      num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                      shift_labels=shift_labels, **kwargs)
        self.used = True
        return chunked_causal_lm_loss(self.head, self.hidden, labels, self.params, num_items_in_batch,
                                      ignore_index, shift_labels)

    def finish(self, output):
        """The output with the placeholder replaced: None where the loss used it, the real logits where not."""
        if self.placeholder is None:
            return output
        value = None
        if not self.used:
            value = self.head(self.hidden)
        if isinstance(output, dict):
            for key in [k for k, v in output.items() if v is self.placeholder]:
                output[key] = value
            return output
        if isinstance(output, tuple):
            return type(output)(value if v is self.placeholder else v for v in output)
        return output


# NOTE [When the chunked loss acts]
# Invariant: the chunked loss replaces only a computation whose result is the loss alone; wherever something reads
# the logits, they are computed as without the library. Rule: a call of a causal LM found by structure acts when
# apply(chunked_loss=True), it runs under DDP (in one process nothing changes), in training mode with grad enabled
# and ``labels`` passed, its ``loss_function`` is transformers' ForCausalLMLoss, its config declares no logit
# transform, its lm_head has no hooks, no instance forward and no active dropout, and no ``compute_loss`` on the
# stack other than transformers' reads ``logits``. Then ``logits`` is None, said once at INFO; every step-aside is
# one line on rank 0, once per reason. Where labels are not passed (Trainer's label smoothing, ``compute_loss_func``)
# it is not reached: one INFO line; nor where TRL (SFT, DPO: its fused LM head) or Liger replaced the model's
# forward and chunk themselves: one INFO line when DDP wraps such a model (``note_fused``).
# Test: tests/test_chunked_loss.py::test_steps_aside_where_logits_are_read.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.2
def _step_aside(key: str, level: int, why: str) -> None:
    log_rank0_once(f"chunked-{key}", level, "ddp_patches: chunked loss steps aside: %s (%s)", why, _SEE)


_SEE = "NOTE [When the chunked loss acts] in ddp_patches/chunked_loss.py"


def _config_problem(model: torch.nn.Module) -> str | None:
    """A logit transform the config declares (read per instance: one class, configs with and without)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [a for a in _LOGIT_TRANSFORMS if getattr(text, a, None) not in (None, 1, 1.0)]
    return f"{type(model).__qualname__} changes its logits before the loss ({found[0]} in its config)" \
        if found else None


def _loss_problem(model: torch.nn.Module) -> str | None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss = vars(model).get("_loss_function")
    if loss is None:
        loss_type = getattr(model, "loss_type", None)
        from transformers.loss.loss_utils import LOSS_MAPPING

        loss = LOSS_MAPPING.get(loss_type or "ForCausalLM", ForCausalLMLoss)
    if loss is not ForCausalLMLoss:
        return f"{type(model).__qualname__}'s loss_function is {getattr(loss, '__qualname__', loss)!r}, not " \
               "transformers' ForCausalLMLoss"
    return None


def _head_problem(head: torch.nn.Module) -> str | None:
    from torch.nn.modules import module as module_mod

    if "forward" in vars(head):
        return "its lm_head has an instance forward (accelerate's device hooks, another library's patch)"
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(module_mod, name, None):
            return f"a global module hook is set (torch.nn.modules.module.{name})"
    for sub in head.modules():
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks:
            return "its lm_head or a submodule of it has a forward or backward hook"
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training and sub.p > 0:
            return "its lm_head applies dropout (LoRA dropout on lm_head: chunks would draw other masks)"
    if any(p._backward_hooks for p in head.parameters() if p.requires_grad):
        return "a trainable lm_head parameter has a tensor hook"
    return None


def _stack_reads_logits() -> str | None:
    """A ``compute_loss`` on the stack, other than transformers.Trainer's, whose code reads ``logits``."""
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "compute_loss" and ("logits" in code.co_names or "logits" in code.co_consts) \
                and not frame.f_globals.get("__name__", "").startswith("transformers."):
            owner = frame.f_locals.get("self")
            return f"{type(owner).__qualname__ if owner is not None else code.co_qualname}.compute_loss reads logits"
        frame = frame.f_back
    return None


def _note_loss_outside() -> None:
    """One INFO line where a Trainer takes the labels out of the forward to compute the loss from the logits
    itself (label smoothing, ``compute_loss_func``): the chunked loss is not reached there."""
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return
        if frame.f_code.co_name == "compute_loss":
            owner = frame.f_locals.get("self")
            for attr, what in (("label_smoother", "label smoothing"), ("compute_loss_func", "compute_loss_func")):
                if getattr(owner, attr, None) is not None:
                    _step_aside(f"outside-{attr}", logging.INFO,
                                f"{type(owner).__qualname__} computes the loss from the logits itself ({what}): the "
                                "model's forward gets no labels, and the logits are built")
                    return
            return
        frame = frame.f_back


def _why_not(model: torch.nn.Module) -> tuple[str, int, str] | None:
    """(key, level, why) of a step-aside, else None. An engine outside ACTS_UNDER says so itself (why: "")."""
    engine = engines.of_module(model)
    if engine not in ACTS_UNDER:
        if engine != engines.NONE:  # one process: nothing changes, nothing said
            engines.step_aside("chunked_loss", engine)
        return ("engine", logging.WARNING, "")
    head = vars(model)["_modules"]["lm_head"]
    for key, level, problem in (("config", logging.INFO, _config_problem(model)),
                                ("loss", logging.INFO, _loss_problem(model)),
                                ("head", logging.WARNING, _head_problem(head)),
                                ("stack", logging.INFO, _stack_reads_logits())):
        if problem is not None:
            return (f"{key}-{problem}", level, problem)
    return None


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


def _imported_candidates() -> list[type]:
    from transformers import PreTrainedModel

    seen, stack, found = set(), [PreTrainedModel], []
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                if _is_candidate_class(sub):
                    found.append(sub)
    return found


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
    patched = [f"{c.__module__}.{c.__qualname__}" for c in _imported_candidates() if _patch_class(c)]
    logger.debug("ddp_patches: chunked loss patched %d causal-LM classes already imported", len(patched))
    return ["transformers.PreTrainedModel.__init__ (chunked-loss discovery)"] + \
        [f"{name}.forward" for name in sorted(patched)]
