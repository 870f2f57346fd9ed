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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

GiB = 1 << 30

# NOTE [What the simulation models]
# Fake tensors run on the CPU device (a CUDA build's fake "cuda" device asks for a device context in backward), so
# what differs by device is modelled, not run:
#   * offload (CUDA only): a layer's input counts as host bytes from the end of its forward until its recompute,
#     when it and the previous layer's input (prefetch 1) count on the device again; the first layer's input (a
#     leaf that requires grad) and the last stay, as the offloader keeps them.
#   * attention: SDPA on fake CPU tensors runs the CPU flash kernel, which saves q, k, v (GQA's k/v unrepeated),
#     the output and the log-sum-exp, as FlashAttention-2 does; its backward adds FA2's workspace while it runs
#     (``flash_backward_workspace``). The model runs ``ATTENTION``, transformers' SDPA with a mask function that
#     returns None (a GPU run without padding builds no S x S mask: SDPA's is_causal).
#   * the fused head: TRL folds each logits tile with one in-place Triton kernel on a GPU, which allocates
#     nothing: its CPU fold (float32 temporaries, results written in place) is not run (``_gpu_folds``).
#   * the allocator: live bytes, not what a caching allocator reserves; ``plan`` keeps a margin for that.
# Test: tests/test_memsim.py::test_calibration_offload_gpu_bound (against the H100 run in docs/data/gpu-proof.json).
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §13


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive, by place ("device" or "host"), with peaks."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.record = record  # keep what made each storage, and the storages alive at the device peak
        self._made: dict = {}  # id(storage) -> (op, dtype, shape, where, [nbytes, place]) while it lives
        self._at_peak: list = []
        self._info: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [nbytes, place]
        self._refs: set = set()
        self.current = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self._paused = 0
        self.pinned = 0  # pinned host bytes taken by offload (size classes), set by ``_offloading``
        self.phase = "embedding"  # set by the caller's hooks: "layer" or "head"
        self.peak_phase = self.phase
        from torch._subclasses.fake_tensor import FakeTensor

        self._fake = FakeTensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and type(args[0]) is self._fake:  # answered here, as FakeTensorMode would: see _DEVICE
            return _META if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        peak = self.peak["device"]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._track(out, func)
        else:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._track(t, func)
        extra = []
        if func in _FLASH_BACKWARD and not self._paused:  # its workspace, beside its outputs while it runs
            workspace = flash_backward_workspace(args[1], args[2])
            self._add("device", workspace)
            self.current["device"] -= workspace
            extra = [(workspace, "FlashAttention-2 backward workspace (modelled)", torch.float32, (), "")]
        if self.record and self.peak["device"] > peak:
            self._snapshot(extra)
        return out

    def _snapshot(self, extra: list = ()) -> None:
        self._at_peak = [(info[0], op, dtype, shape, where) for op, dtype, shape, where, info in self._made.values()
                         if info[1] == "device"] + list(extra)

    def peak_listing(self) -> list:
        """With ``record``: (bytes, op, dtype, shape, where made) of each storage alive at the device peak, largest
        first (a debugging aid: what a peak is made of)."""
        return sorted(self._at_peak, key=lambda row: -row[0])

    def exclude(self, tensors) -> None:
        """Storages that exist before the step (parameters, buffers, inputs): never counted, nor their views."""
        for t in tensors:
            self._info[t.untyped_storage()] = [0, "device"]

    @contextlib.contextmanager
    def uncounted(self):
        """Storages made inside are not counted (work a GPU kernel does in place)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _track(self, t: torch.Tensor, func=None) -> None:
        storage = t.untyped_storage()
        if storage in self._info:
            return
        # an untracked storage seen through a view was made before the step (a weight's transpose): not counted
        info = [0 if t._is_view() or self._paused else storage.nbytes(), "device"]
        self._info[storage] = info
        key = id(storage)
        if self.record and info[0]:
            self._made[key] = (str(func), t.dtype, tuple(t.shape), _where(), info)
        self._add(info[1], info[0])

        def gone(ref, info=info, key=key):
            self._refs.discard(ref)
            self._made.pop(key, None)
            self.current[info[1]] -= info[0]

        self._refs.add(weakref.ref(storage, gone))

    def _add(self, place: str, nbytes: int) -> None:
        self.current[place] += nbytes
        if self.current[place] > self.peak[place]:
            self.peak[place] = self.current[place]
            if place == "device":
                self.peak_phase = self.phase

    def move(self, t: torch.Tensor, place: str) -> int:
        """Count ``t``'s storage at ``place`` from now on; the bytes moved (0 if untracked or already there)."""
        info = self._info.get(t.untyped_storage())
        if info is None or info[1] == place:
            return 0
        self.current[info[1]] -= info[0]
        info[1] = place
        peak = self.peak["device"]
        self._add(place, info[0])
        if self.record and self.peak["device"] > peak:
            self._snapshot()
        return info[0]


def _where() -> str:
    """The innermost frames of the model's and the library's code that made a storage (``LiveBytes(record=True)``)."""
    import sys

    frame, found = sys._getframe(2), []
    while frame is not None and len(found) < 3:
        name = frame.f_code.co_filename
        if any(k in name for k in ("transformers", "peft", "trl", "ddp_patches")) and not name.endswith("memsim.py"):
            found.append(f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(found)


_FLASH_BACKWARD = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,)
# ``tensor.device`` of a fake tensor reaches every mode as ``prim.device``: two in three of the calls a step
# dispatches (autograd and the model code ask it). ``LiveBytes`` answers it as FakeTensorMode's own handler does (the
# fake device, or meta inside a kernel) rather than passing it down: a device is no storage, so nothing counted
# changes (tests/test_memsim.py::test_device_queries_answered_in_live_bytes).
_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")


def flash_backward_workspace(query: torch.Tensor, key: torch.Tensor) -> int:
    """The bytes FlashAttention-2's backward (``mha_bwd``, also PyTorch's SDPA flash kernel) allocates beside its
    outputs: ``dq_accum`` in float32 (query rows rounded up to 128, head size to 32) and, where key/value have fewer
    heads (GQA), dk and dv expanded to the query's heads (NOTE [What the simulation models])."""
    batch, heads, rows, head = query.shape
    workspace = batch * heads * -(-rows // 128) * 128 * -(-head // 32) * 32 * 4 + batch * heads * rows * 4
    if key.shape[1] != heads:
        workspace += 2 * batch * key.shape[2] * heads * head * query.element_size()
    return workspace


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


def _config(config):
    """A transformers config from a PretrainedConfig, a dict with its model_type, a config.json or a model folder;
    a clear ValueError (or FileNotFoundError) for anything else, before any model is built."""
    config = _load_config(config)
    _check_sizes(_text_config(config))
    return config


def _load_config(config):
    from transformers import PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):
        return _from_dict(config)
    import os

    path = os.fspath(config)
    if os.path.isfile(path):
        return _from_dict(_read_json(path))
    if os.path.isdir(path):
        return _from_folder(path)
    raise FileNotFoundError(f"ddp_patches.memsim: expected a local config.json or a model folder holding one; found "
                            f"no such path: {path!r} (nothing is downloaded: save the model's config.json first)")


def _read_json(path: str) -> dict:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, OSError) as e:  # not JSON, not UTF-8, not readable
        raise ValueError(f"ddp_patches.memsim: expected {path!r} to be a model's config.json (a JSON object); "
                         f"could not read it ({_first_line(e)}): pass the config.json of a causal LM") from None
    if not isinstance(data, dict):
        raise ValueError(f"ddp_patches.memsim: expected {path!r} to hold a JSON object with a model_type; found a "
                         f"JSON {type(data).__name__}: pass the config.json of a causal LM")
    return data


def _from_dict(config: dict):
    from types import SimpleNamespace

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = dict(config)
    if "model_type" not in data:
        raise ValueError("ddp_patches.memsim: a config dict needs its model_type (e.g. 'llama'); found keys "
                         f"{sorted(data)[:8]}")
    model_type = data.pop("model_type")
    _check_sizes(SimpleNamespace(**{k: v for k, v in data.items() if k in SIZES}))  # before transformers divides
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"ddp_patches.memsim: expected a model_type this transformers knows (e.g. 'llama', "
                         f"'qwen2'); found {model_type!r}: check its spelling, or upgrade transformers")
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as e:  # noqa: BLE001 -- any refusal of the values (transformers' strict fields raise their own)
        raise ValueError(f"ddp_patches.memsim: the {model_type} config is not one transformers accepts "
                         f"({_first_line(e)}): pass the model's own config.json") from None


def _from_folder(path: str):
    import os

    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"ddp_patches.memsim: expected a model folder holding a config.json; found none in "
                                f"{path!r} (nothing is downloaded: save the model's config.json there first)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"ddp_patches.memsim: the config.json in {path!r} is not one transformers reads "
                         f"({_first_line(e)}): pass the model's own config.json") from None


def _first_line(error: BaseException) -> str:
    """An error's message on one line: its first lines joined, at most 200 characters."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return " ".join(lines[:2])[:200] or type(error).__name__


SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "vocab_size", "head_dim")  # each, where a config sets it, a count of at least 1


def _check_sizes(text) -> None:
    """A size of 0 or less, or a head width of 0 (hidden_size < num_attention_heads without head_dim), fails
    deep inside the model's constructor: refused here, naming the field."""
    for name in SIZES:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"ddp_patches.memsim: expected {name} >= 1 in the config; found {value}: pass the "
                             "model's own config.json")
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if getattr(text, "head_dim", None) is None and isinstance(hidden, int) and isinstance(heads, int) \
            and hidden < heads:
        raise ValueError(f"ddp_patches.memsim: expected hidden_size >= num_attention_heads (a head width of at "
                         f"least 1); found {hidden} and {heads}: pass the model's own config.json")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _with_layers(config, layers: int):
    import copy

    config = copy.deepcopy(config)
    text = _text_config(config)
    text.num_hidden_layers = layers
    for name in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the count
        value = getattr(text, name, None)
        if isinstance(value, list) and len(value) > layers:
            setattr(text, name, value[:layers])
    return config


ATTENTION = "ddp_patches_simulated_sdpa"


def _register_attention() -> None:
    """SDPA with ``is_causal`` and no mask (NOTE [What the simulation models]), as a named implementation."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)


def build(config, *, layers: int, lora_r: int, dtype=torch.bfloat16):
    """The causal LM of ``config`` with ``layers`` decoder layers, LoRA r=``lora_r`` on every linear layer of the
    decoder, on the meta device (no memory), checkpointing non-reentrant (the form that works under DDP)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _register_attention()
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_with_layers(config, layers), dtype=dtype,
                                                     attn_implementation=ATTENTION)
    except ValueError as e:  # a VLM's config, an encoder, an attention kind transformers refuses for this class
        raise ValueError(f"ddp_patches.memsim: expected the config of a causal LM that runs SDPA; "
                         f"{config.model_type} does not build as one ({str(e).splitlines()[0][:200]}). For a VLM, "
                         "pass its language model's config (text_config with its own model_type)") from None
    _check_decoder(model, config.model_type)
    model.config.use_cache = False
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules="all-linear")
    model = get_peft_model(model, lora)
    model.train()
    return model


def _check_decoder(model, model_type: str) -> None:
    """An encoder's config (BERT, RoBERTa) builds as a "causal LM" whose self-attention is bidirectional: refused,
    as every attention module that says whether it is causal says it is not."""
    causal = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if causal and not any(causal):
        raise ValueError(f"ddp_patches.memsim: expected the config of a decoder (a causal LM such as llama, qwen2 or "
                         f"mistral); found {model_type}, whose self-attention is bidirectional (an encoder): pass a "
                         "decoder's config.json")


def _materialise(model) -> None:
    """Parameters and buffers as fake CPU tensors (under the active FakeTensorMode), outside any LiveBytes."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                               requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


_static: dict = {}


def static_bytes(config, *, layers: int, lora_r: int, dtype=torch.bfloat16, quant: str | None = None,
                 kbit_prep: bool = False) -> tuple[int, int]:
    """(frozen weights and buffers, LoRA state) of the whole model: they do not depend on the length.
    ``quant="nf4"``: the decoder's frozen linear weights as QLoRA stores them (``nf4_bytes``); the embeddings, the
    LM head and the norms stay in ``dtype`` (bitsandbytes keeps the head unquantised)."""
    if quant not in (None, "nf4"):
        raise ValueError(f"ddp_patches.memsim: expected quant None or 'nf4' (QLoRA's 4-bit base); found {quant!r}")
    key = (config.to_json_string(), layers, lora_r, dtype, quant, kbit_prep)
    if key not in _static:
        model = build(config, layers=layers, lora_r=lora_r, dtype=dtype)
        if kbit_prep:  # NOTE [The k-bit preparation's float32]
            _upcast_unquantised(model)
        _static[key] = _static_bytes(model, quant)
    return _static[key]


NF4_BLOCK = 64  # bitsandbytes' 4-bit block size: one absmax per 64 weights
NF4_NESTED_BLOCK = 256  # double quantisation: the absmaxes as uint8, one float32 scale per 256 of them


def nf4_bytes(numel: int, *, double_quant: bool = True) -> int:
    """Bytes of one weight stored by bitsandbytes as NF4: two weights a byte, plus its quant state (the absmax of
    each block; with double quantisation, QLoRA's default, those as uint8 with float32 scales, a 256-entry code and
    an offset; the 16-entry NF4 code)."""
    blocks = -(-numel // NF4_BLOCK)
    state = 16 * 4
    if double_quant:
        state += blocks + 4 * -(-blocks // NF4_NESTED_BLOCK) + 256 * 4 + 4
    else:
        state += 4 * blocks
    return -(-numel // 2) + state


def _quantised(model) -> list:
    """The frozen weights QLoRA stores as NF4: every linear layer's base weight inside the decoder layers."""
    found = []
    for layer in _decoder_layers(model):
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
                found.append(module.weight)
    return found


def _dequantised_bytes(config, dtype) -> int:
    """The transient of QLoRA's matmul: the largest base weight dequantised to ``dtype`` (forward and backward)."""
    text = _text_config(config)
    hidden = text.hidden_size
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    return hidden * max(inter, hidden) * torch.empty((), dtype=dtype).element_size()


def _static_bytes(model, quant: str | None = None) -> tuple[int, int]:
    weights = sum(t.numel() * t.element_size() for t in model.parameters() if not t.requires_grad)
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    if quant:
        for w in _quantised(model):
            weights += nf4_bytes(w.numel()) - w.numel() * w.element_size()
    lora = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return weights, lora * 2 + sum(p.numel() * 4 * 2 for p in model.parameters() if p.requires_grad)


def _decoder_layers(model) -> list:
    """The decoder's layers: the ModuleList of ``num_hidden_layers`` modules of one class (GPT-NeoX's ``layers``,
    GPT-2's ``h``, Llama's ``layers``); a clear error where there is none."""
    count = _text_config(model.config).num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and len({type(m) for m in module}) == 1:
            return list(module)
    raise ValueError(f"ddp_patches.memsim: expected a ModuleList of {count} decoder layers in "
                     f"{type(model.get_base_model()).__name__}; found none, so offload cannot be modelled")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def size_class(nbytes: int) -> int:
    """The pinned bytes one offloaded tensor takes: the pool's power-of-two class (``pinned_pool.size_class``)."""
    from .offload.pinned_pool import size_class as pool_class

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
    from . import tiled_mlp

    patched = []
    for layer in _decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if getattr(mlp, "gate_proj", None) is None:
            continue
        original = mlp.forward

        def forward(x, original=original, mlp=mlp):
            hidden = x.shape[-1]
            rows = x.numel() // hidden
            sizes = tiled_mlp.shard_sizes(rows, hidden, None, tiled_mlp.rules._intermediate(mlp, x))  # the patch rule
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

    package = sys.modules[__package__]
    if importlib.machinery.PathFinder.find_spec(f"{__package__}.{name}", list(package.__path__)) is None:
        return None
    return importlib.import_module(f"{__package__}.{name}")


def _attention_tiling(model):
    """Each decoder attention block (input norm, q/k/v, o_proj) through the library's tiled attention with its
    automatic shard rule, as ``apply(tiled_attention=True)`` runs it under DDP (here in one process)."""
    from . import tiled_attention

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
        from .chunked_loss import chunked_causal_lm_loss

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


_models: dict = {}  # (config, layers, rank, dtype) -> (model, its FakeTensorMode): built once per planner call
_MODELS_KEPT = 8


# NOTE [The k-bit preparation's float32]
# Rule: QLoRA recipes call PEFT's ``prepare_model_for_kbit_training``, which upcasts every parameter not stored in
# 4 bits to float32 (embeddings, norms, LM head; documented in PEFT) and trains under bf16 autocast. Llama's
# RMSNorm multiplies its float32 weight into its output, so the residual stream, and each checkpointed layer's
# input, is float32: twice the bytes a token. ``Features(kbit_prep=True)`` builds the model so and runs the step
# under CPU autocast (bf16): the linear layers and attention compute in bf16 as on the GPU.
# Test: tests/test_memsim.py::test_kbit_preparation_keeps_float32_hidden_states
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §13


def _upcast_unquantised(model) -> None:
    """``prepare_model_for_kbit_training``'s upcast: every frozen parameter QLoRA does not store in 4 bits."""
    quantised = {id(w) for w in _quantised(model)}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad and id(p) not in quantised and p.dtype != torch.float32:
                module._parameters[name] = torch.nn.Parameter(p.to(torch.float32), requires_grad=False)


def _fake_model(config, layers: int, lora_r: int, dtype, kbit_prep: bool = False):
    """The model of ``build`` with fake parameters, and the FakeTensorMode they belong to; built once and reused
    (a run leaves nothing behind: its hooks and patches are removed, its gradients dropped). ``kbit_prep``:
    NOTE [The k-bit preparation's float32]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    key = (config.to_json_string(), layers, lora_r, dtype, kbit_prep)
    if key not in _models:
        model = build(config, layers=layers, lora_r=lora_r, dtype=dtype)
        if kbit_prep:
            _upcast_unquantised(model)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            _materialise(model)
        while len(_models) >= _MODELS_KEPT:
            _models.pop(next(iter(_models)))
        _models[key] = (model, mode)
    return _models[key]


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

    from . import tiled_mlp

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
