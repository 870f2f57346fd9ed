"""The memory of one LoRA training step at the shapes users train, without a GPU: a simulation.

A real transformers model class is built from its config on the meta device, given LoRA by PEFT, and run forward
and backward on fake tensors (``FakeTensorMode``: shapes and dtypes, no data), while ``LiveBytes`` counts the bytes
of every storage created in the step that is still alive. What the library adds runs as its own code (the tiled
MLP's ``apply_tiled`` and shard rule; TRL's chunked head for the fused loss); what depends on a device is modelled
and said so: NOTE [What the simulation models].
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch

from .live_bytes import LiveBytes
from .model import _config, _decoder_layers, _dequantised_bytes, _fake_model, _materialise, _text_config, static_bytes

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Features:
    """What the step runs with: the library's tiled MLP and offload, and a fused (chunked) LM head and loss.

    ``chunked_loss``: the library's chunked LM-head loss (``apply(chunked_loss=True)``: ``chunked_causal_lm_loss``
    on the decoder's hidden states). ``tiled_attention``: the sequence-tiled attention block
    (``ddp_patches.tiled_attention.tile_model``), as ``_tiling`` runs the tiled MLP."""

    tiled_mlp: bool = False
    offload: bool = False
    fused_head: bool = False
    chunked_loss: bool = False
    tiled_attention: bool = False
    legacy_loss: bool = False  # transformers <= 4.45's Llama loss: logits.float(), then a contiguous shifted copy
    kbit_prep: bool = False  # PEFT's prepare_model_for_kbit_training: NOTE [The k-bit preparation's float32]

    @property
    def chunked_head(self) -> bool:
        return self.fused_head or self.chunked_loss  # the LM head never builds the whole logits


@dataclasses.dataclass
class Step:
    """One simulated step: bytes by kind (per device) and what the peak is made of."""

    seq: int
    layers: int
    weights: int  # frozen base weights (and buffers)
    lora: int  # LoRA parameters, their gradients and AdamW's two states
    activations: int  # the peak of live bytes created in the step (forward, backward, loss)
    host: int  # the peak of bytes offloaded to the host
    per_layer: int  # what one more layer adds to the activation peak
    peak_in: str = "layer"  # where the activation peak is: "layer" (a layer's recompute) or "head" (head and loss)
    batch: int = 1  # sequences of ``seq`` tokens in the step
    pinned: int = 0  # pinned host bytes offload takes (the pool's power-of-two classes)
    per_layer_host: int = 0  # one offloaded layer input's bytes (uncapped), beside ``per_layer`` on the device

    @property
    def device(self) -> int:
        return self.weights + self.lora + self.activations

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "device": self.device}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def size_class(nbytes: int) -> int:
    """The pinned bytes one offloaded tensor takes: the pool's power-of-two class (``pinned_pool.size_class``)."""
    from ..offload.pinned_pool import size_class as pool_class

    return pool_class(nbytes)


@contextlib.contextmanager
def _offloading(model, live: LiveBytes, pinned_cap: int | None = None):
    """Offload as modelled (NOTE [What the simulation models]): a layer's input is host bytes between the end of
    its forward and its recompute; at layer k's recompute the input of layer k-1 comes back too (prefetch 1).
    Under ``pinned_cap`` the pool's rule: an input whose size class no longer fits beside the classes taken stays
    on the device (``live.pinned``: the pinned bytes taken)."""
    layers = _decoder_layers(model)
    inputs: dict[int, weakref.ref] = {}

    def hidden(args, kwargs):
        return args[0] if args else kwargs.get("hidden_states")

    def bring_back(k: int) -> None:
        ref = inputs.get(k)
        t = ref() if ref is not None else None
        if t is not None:
            live.move(t, "device")

    def pre(k):
        def hook(module, args):
            if _in_backward():
                bring_back(k)
                bring_back(k - 1)
        hook.observes_only = True  # changes no tensor: the tiled attention may run it once per shard
        return hook

    def post(k):
        def hook(module, args, kwargs, output):
            x = hidden(args, kwargs)
            if _in_backward() or not torch.is_grad_enabled() or x is None or k in (0, len(layers) - 1):
                return
            wanted = size_class(x.untyped_storage().nbytes())
            if pinned_cap is not None and live.pinned + wanted > pinned_cap:
                return  # the pool refuses: the input stays on the device
            live.pinned += wanted
            inputs[k] = weakref.ref(x)
            live.move(x, "host")
        return hook

    # the recompute runs a layer's forward, not its __call__ (transformers 5 checkpoints forward so that a layer's
    # own hooks stay outside): its children's hooks see it
    handles = [child.register_forward_pre_hook(pre(k)) for k, layer in enumerate(layers) for child in layer.children()]
    handles += [layer.register_forward_hook(post(k), with_kwargs=True) for k, layer in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _tiling(model):
    """Each decoder MLP through the library's ``apply_tiled`` with its automatic shard rule, as
    ``apply(tiled_mlp=True)`` runs it under DDP (here without the distributed gate)."""
    from .. import tiled_mlp

    patched = []
    for layer in _decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if getattr(mlp, "gate_proj", None) is None:
            continue
        original = mlp.forward

        def forward(x, original=original, mlp=mlp):
            hidden = x.shape[-1]
            rows = x.numel() // hidden
            sizes = tiled_mlp.shard_sizes(rows, hidden, None, tiled_mlp.rules.intermediate_width(mlp, x))  # the patch rule
            if not torch.is_grad_enabled() or len(sizes) == 1:
                return original(x)
            params = tuple(p for p in mlp.parameters() if p.requires_grad)
            out = tiled_mlp.apply_tiled(original, sizes, x.reshape(rows, hidden), params)
            return out.view(*x.shape[:-1], out.shape[-1])

        mlp.forward = forward
        patched.append(mlp)
    try:
        yield
    finally:
        for mlp in patched:
            del mlp.forward


def own_module(name: str):
    """``ddp_patches.<name>`` where this package's own folder has it, else None (an editable install of another
    checkout must not lend its modules)."""
    import importlib
    import importlib.machinery
    import sys

    top = __package__.rpartition(".")[0]  # ddp_patches: this module sits in ddp_patches.plan
    package = sys.modules[top]
    if importlib.machinery.PathFinder.find_spec(f"{top}.{name}", list(package.__path__)) is None:
        return None
    return importlib.import_module(f"{top}.{name}")


def _attention_tiling(model):
    """Each decoder attention block (input norm, q/k/v, o_proj) through the library's tiled attention with its
    automatic shard rule, as ``apply(tiled_attention=True)`` runs it under DDP (here in one process)."""
    from .. import tiled_attention

    return tiled_attention.tile_model(model)


def tiled_attention_available() -> bool:
    """Whether this package has the tiled attention (it has: kept for callers that asked before it landed)."""
    return own_module("tiled_attention") is not None


@contextlib.contextmanager
def _gpu_folds(live: LiveBytes):
    """TRL's tile folds as the GPU runs them (NOTE [What the simulation models]); restored on exit."""
    from trl.kernels import chunked_logprob

    saved = {name: vars(chunked_logprob)[name] for name in ("_forward_tile", "_backward_tile")
             if name in vars(chunked_logprob)}  # a TRL without them: its torch ops are counted as they run

    def no_fold(*args, **kwargs):
        return None  # the fold writes its accumulators and the tile in place: on fake tensors nothing is left to run

    for name in saved:
        setattr(chunked_logprob, name, no_fold)
    try:
        yield
    finally:
        for name, fold in saved.items():
            setattr(chunked_logprob, name, fold)


def _loss(model, ids: torch.Tensor, fused_head: bool, legacy: bool = False, chunked_loss: bool = False
          ) -> torch.Tensor:
    if legacy and not fused_head:  # LlamaForCausalLM.forward of transformers 4.44 (what published 2024 runs used)
        logits = model(input_ids=ids).logits.float()
        shift_logits = logits[..., :-1, :].contiguous().view(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(shift_logits, ids[..., 1:].contiguous().view(-1))
    if not fused_head:
        return model(input_ids=ids, labels=ids).loss  # transformers' own: logits, their float32 upcast, the loss
    if chunked_loss:  # the library's own: its Function on the decoder's hidden states, as apply(chunked_loss=True)
        from ..chunked_loss import chunked_causal_lm_loss

        base = model.get_base_model()
        head = base.get_output_embeddings()
        hidden = base.base_model(input_ids=ids).last_hidden_state
        return chunked_causal_lm_loss(head, hidden, ids, tuple(p for p in head.parameters() if p.requires_grad))
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    base = model.get_base_model()
    hidden = base.base_model(input_ids=ids).last_hidden_state  # the decoder (Llama's model, GPT-NeoX's gpt_neox)
    head = base.get_output_embeddings()
    rows = hidden[:, :-1] if ids.shape[0] > 1 else hidden[0, :-1]  # batch 1: the view the calibration ran
    out = ChunkedLogProbFunction.apply(rows.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                       ids[:, 1:].reshape(-1), 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                       ("log_probs",))
    return -out[0].mean()


@contextlib.contextmanager
def _phases(model, live: LiveBytes):
    """Where the step is, for the peak: "layer" while a decoder layer's parts run (forward or recompute), "head"
    from the end of the last layer's forward (the final norm, LM head and loss, and their backward, come before any
    recompute)."""
    layers = _decoder_layers(model)

    def enter(module, args):
        live.phase = "layer"

    enter.observes_only = True  # the tiled attention may run it once per shard (its input norm's hooks)

    def leave(module, args, output):
        if not _in_backward():
            live.phase = "head"

    handles = [child.register_forward_pre_hook(enter) for layer in layers for child in layer.children()]
    handles.append(layers[-1].register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def fused_head_available() -> bool:
    """Whether this TRL has the chunked head the fused-head setups run (``trl.kernels.ChunkedLogProbFunction``)."""
    try:
        from trl.kernels import ChunkedLogProbFunction  # noqa: F401
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # noqa: F401
    except ImportError:
        return False
    return True


_runs: dict = {}  # the last runs' results (their LiveBytes): a search asks for some twice
_RUNS_KEPT = 64


def activation_run(config, seq: int, features: Features, *, layers: int, lora_r: int = 16,
                   dtype=torch.bfloat16, batch: int = 1, pinned_cap: int | None = None,
                   record: bool = False) -> LiveBytes:
    """One forward + backward of ``layers`` layers at ``batch`` x ``seq`` tokens; its ``LiveBytes`` (peaks, peak
    phase, pinned bytes). ``pinned_cap``: offload's pinned-pool cap (None: no cap). ``record``: with
    ``peak_listing()``, what the device peak is made of (not cached)."""
    config = _config(config)
    if record:
        return _activation_run(config, seq, features, layers=layers, lora_r=lora_r, dtype=dtype, batch=batch,
                               pinned_cap=pinned_cap, record=True)
    key = (config.to_json_string(), seq, features, layers, lora_r, dtype, batch, pinned_cap)
    if key not in _runs:
        while len(_runs) >= _RUNS_KEPT:
            _runs.pop(next(iter(_runs)))
        _runs[key] = _activation_run(config, seq, features, layers=layers, lora_r=lora_r, dtype=dtype, batch=batch,
                                     pinned_cap=pinned_cap)
    return _runs[key]


def _activation_run(config, seq: int, features: Features, *, layers: int, lora_r: int, dtype, batch: int,
                    pinned_cap: int | None, record: bool = False) -> LiveBytes:
    if features.fused_head and not fused_head_available():
        raise ImportError("ddp_patches.memsim: the fused head runs TRL's chunked head (trl.kernels."
                          "ChunkedLogProbFunction); this TRL has none: upgrade TRL (1.16 has it)")
    model, mode = _fake_model(config, layers, lora_r, dtype, features.kbit_prep)
    with mode:
        ids = torch.zeros(batch, seq, dtype=torch.long)
        live = LiveBytes(record)
        live.exclude([*model.parameters(), *model.buffers(), ids])
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(_phases(model, live))
                if features.offload:
                    stack.enter_context(_offloading(model, live, pinned_cap))
                if features.tiled_mlp:
                    stack.enter_context(_tiling(model))
                if features.tiled_attention:
                    stack.enter_context(_attention_tiling(model))
                if features.fused_head:
                    stack.enter_context(_gpu_folds(live))
                if features.kbit_prep:
                    stack.enter_context(torch.autocast("cpu", dtype=dtype))
                with live:
                    _loss(model, ids, features.chunked_head, features.legacy_loss, features.chunked_loss).backward()
        finally:
            for p in model.parameters():
                p.grad = None
    return live


def activation_peak(config, seq: int, features: Features, *, layers: int, lora_r: int = 16,
                    dtype=torch.bfloat16) -> tuple[int, int]:
    """(device, host) peak bytes created in one forward + backward of ``layers`` layers at ``seq`` tokens."""
    live = activation_run(config, seq, features, layers=layers, lora_r=lora_r, dtype=dtype)
    return live.peak["device"], live.peak["host"]


PROBE_LAYERS = (3, 4)  # the per-layer increment is measured between these (offload keeps the first and last)

# NOTE [Pinned cap in the simulation]
# Rule: offload under a pinned cap is the pool's: each offloaded input takes its power-of-two size class, and an
# input whose class no longer fits beside those taken stays on the device (the first middle layers go to the host,
# the later ones stay). Run whole, ``_offloading`` applies it; extrapolated from 3 and 4 layers (run uncapped), the
# inputs kept add one input each to the peak, less the one the uncapped run had already prefetched back when the
# peak is in a layer's recompute (at the LM head nothing is prefetched). Against 8 layers run whole: exact with the
# peak at the head, 0.2% high in a recompute (the planner errs short).
# Test: tests/test_memsim.py::test_pinned_cap_keeps_the_excess_on_the_device
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §13


def simulate(config, seq: int, features: Features = Features(), *, lora_r: int = 16, layers: int | None = None,
             dtype=torch.bfloat16, batch: int = 1, pinned_cap: int | None = None, quant: str | None = None,
             per_layer: tuple[int, int] | None = None) -> Step:
    """One training step of ``config``'s causal LM at ``batch`` x ``seq`` tokens, LoRA r=``lora_r``: a simulation.

    With more layers than ``PROBE_LAYERS``, the activation peak is the one of 4 layers plus what each further layer
    adds (measured between 3 and 4 layers: a checkpointed layer keeps only its input, on the device or the host;
    ``per_layer``: that increment's (device, host) bytes already known at this length, and then 3 layers run
    alone). Offload under ``pinned_cap``: NOTE [Pinned cap in the simulation]. ``quant="nf4"``: QLoRA's frozen
    base linear weights as bitsandbytes NF4 (``nf4_bytes``), activations still simulated in ``dtype``.
    """
    config = _config(config)
    total = layers or _text_config(config).num_hidden_layers
    small, large = PROBE_LAYERS
    run_args = {"lora_r": lora_r, "dtype": dtype, "batch": batch}
    pinned = per_host = 0
    if total <= large:
        run = activation_run(config, seq, features, layers=total, pinned_cap=pinned_cap, **run_args)
        act, host, per_layer_device, pinned = run.peak["device"], run.peak["host"], 0, run.pinned
    else:
        if per_layer is None:
            run = activation_run(config, seq, features, layers=large, **run_args)
            few = activation_run(config, seq, features, layers=small, **run_args)
            per_layer = (run.peak["device"] - few.peak["device"], run.peak["host"] - few.peak["host"])
        else:  # the increment is known: the smaller probe alone
            run, large = activation_run(config, seq, features, layers=small, **run_args), small
        per_layer_device, per_host = per_layer
        act = run.peak["device"] + (total - large) * per_layer_device
        moved = (total - 2) if per_host > 0 else 0  # offload keeps the first and the last layer's input
        host, pinned = moved * per_host, moved * size_class(per_host) if moved else 0
    weights, lora = static_bytes(config, layers=total, lora_r=lora_r, dtype=dtype, quant=quant,
                                 kbit_prep=features.kbit_prep)
    if quant:
        act += _dequantised_bytes(config, dtype)
    step = Step(seq=seq, layers=total, weights=weights, lora=lora, activations=act, host=host,
                per_layer=per_layer_device, peak_in=run.peak_phase, batch=batch, pinned=pinned,
                per_layer_host=per_host)
    return step if total <= large else capped(step, pinned_cap)


def capped(step: Step, pinned_cap: int | None) -> Step:
    """``step`` (extrapolated, offload uncapped) under offload's pinned cap: NOTE [Pinned cap in the simulation]."""
    per_host = step.per_layer_host
    moved = (step.layers - 2) if per_host > 0 else 0
    if not moved or pinned_cap is None:
        return step
    kept = moved - min(moved, pinned_cap // size_class(per_host))
    if not kept:
        return step
    extra = kept * per_host - (per_host if step.peak_in == "layer" else 0)
    return dataclasses.replace(step, activations=step.activations + extra, host=(moved - kept) * per_host,
                               pinned=(moved - kept) * size_class(per_host))


def mlp_peak(hidden: int, intermediate: int, tokens: int, *, tiled: bool, shards: int | None = None,
             lora_r: int = 8, dtype=torch.bfloat16) -> int:
    """Peak bytes of one Llama MLP (LoRA on gate/up/down) forward + backward on ``tokens`` rows, tiled (in
    ``shards`` even shards, or by the library's rule when None) or not: what benchmarks/tiled_mlp.py measures."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.llama.modeling_llama import LlamaMLP

    from .. import tiled_mlp

    config = SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu", mlp_bias=False)
    with torch.device("meta"):
        mlp = LlamaMLP(config).to(dtype)
        model = get_peft_model(mlp, LoraConfig(r=lora_r, lora_alpha=2 * lora_r,
                                               target_modules=["gate_proj", "up_proj", "down_proj"]))
    with FakeTensorMode(allow_non_fake_inputs=True):
        _materialise(model)
        x = torch.empty(tokens, hidden, dtype=dtype)
        grad = torch.empty(tokens, hidden, dtype=dtype)
        live = LiveBytes()
        live.exclude([*model.parameters(), x, grad])
        forward = model.get_base_model().forward
        sizes = [tokens]
        if tiled:
            sizes = tiled_mlp.shard_sizes(tokens, hidden, -(-tokens // shards) if shards else None, intermediate)
        params = tuple(p for p in model.parameters() if p.requires_grad)
        with live:
            out = forward(x) if len(sizes) == 1 else tiled_mlp.apply_tiled(forward, sizes, x, params)
            out.backward(grad)
    return live.peak["device"]
