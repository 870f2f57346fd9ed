"""The chunked LM loss itself: ``ChunkedCrossEntropy`` and ``chunked_causal_lm_loss``.

transformers' ForCausalLMLoss on ``head(hidden)``, computed in chunks of tokens (NOTE [Chunks by shapes]) without
the full logits [B, S, V] or their float32 copy; the gradients are taken in forward, one per parameter
(NOTE [One gradient per parameter, computed in forward]). ``unchunked()`` computes the loss as without the library
inside a block, ``chunk_rows(n)`` fixes the chunk size, ``counts()`` says how many calls were chunked.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn.functional as F

from ..rescue.edges import needs_defined_zero

_settings: dict = {"chunk_rows": None, "unchunked": 0}
_counts = {"chunked_calls": 0, "chunks": 0}


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
# hook), keeps grad_hidden ([tokens, H]) and one gradient per parameter summed in float32 (as the unchunked
# matmul accumulates over all tokens; a float16 sum overflows), and drops the chunk's logits. Every trainable head
# parameter is an input of the Function, so its backward only scales the kept gradients by the incoming one (in
# float32 for the parameters) and returns them once: no recompute in backward, one hook each (find_unused
# True/False, static_graph, no_sync and bucket views hold, as for the tiled MLP:
# NOTE [Why the parameters are inputs of the Function]). A second-order backward through it raises. The sum, not
# the mean, keeps a loss scale (GradScaler, DeepSpeed fp16) where the unchunked loss has it: in float16 logits.
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
                    grads[i] = g.float() if grads[i] is None else grads[i].add_(g)
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
        grads = [None if g is None else (g * grad_out).to(p.dtype) for g, p in zip(ctx.grads, ctx.params)]
        # A parameter no chunk used: None, or the zero a static-graph DDP needs (as in tiled_mlp/function.py).
        for i in ctx.wanted:
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
