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
#   * attention: SDPA on fake CPU tensors runs the CPU flash kernel, which saves the output and the log-sum-exp,
#     as FlashAttention-2 does. transformers cannot read a fake tensor and would build an S x S mask that a GPU run
#     without padding never builds (SDPA's is_causal); the model runs ``ATTENTION``, transformers' SDPA function
#     with a mask function that returns None, registered through its AttentionInterface.
#   * the fused head: TRL folds each logits tile with one in-place Triton kernel on a GPU; the float32
#     temporaries of its CPU fold are not counted (``_gpu_folds``).
#   * the allocator: live bytes, not what a caching allocator reserves; ``plan`` keeps a margin for that.
# Test: tests/test_memsim.py::test_calibration_offload_gpu_bound (against the H100 run in docs/data/gpu-proof.json).


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive, by place ("device" or "host"), with peaks."""

    def __init__(self) -> None:
        super().__init__()
        self._info: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [nbytes, place]
        self._refs: set = set()
        self.current = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self._paused = 0
        self.phase = "embedding"  # set by the caller's hooks: "layer" or "head"
        self.peak_phase = self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

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

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._info:
            return
        # an untracked storage seen through a view was made before the step (a weight's transpose): not counted
        info = [0 if t._is_view() or self._paused else storage.nbytes(), "device"]
        self._info[storage] = info
        self._add(info[1], info[0])

        def gone(ref, info=info):
            self._refs.discard(ref)
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
        self._add(place, info[0])
        return info[0]


@dataclasses.dataclass(frozen=True)
class Features:
    """What the step runs with: the library's tiled MLP and offload, and a fused (chunked) LM head and loss."""

    tiled_mlp: bool = False
    offload: bool = False
    fused_head: bool = False


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


def static_bytes(config, *, layers: int, lora_r: int, dtype=torch.bfloat16) -> tuple[int, int]:
    """(frozen weights and buffers, LoRA state) of the whole model: they do not depend on the length."""
    key = (config.to_json_string(), layers, lora_r, dtype)
    if key not in _static:
        _static[key] = _static_bytes(build(config, layers=layers, lora_r=lora_r, dtype=dtype))
    return _static[key]


def _static_bytes(model) -> tuple[int, int]:
    weights = sum(t.numel() * t.element_size() for t in model.parameters() if not t.requires_grad)
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
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


@contextlib.contextmanager
def _offloading(model, live: LiveBytes):
    """Offload as modelled (NOTE [What the simulation models]): a layer's input is host bytes between the end of
    its forward and its recompute; at layer k's recompute the input of layer k-1 comes back too (prefetch 1)."""
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
        return hook

    def post(k):
        def hook(module, args, kwargs, output):
            x = hidden(args, kwargs)
            if _in_backward() or not torch.is_grad_enabled() or x is None or k in (0, len(layers) - 1):
                return
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
            sizes = tiled_mlp.shard_sizes(rows, hidden, None, tiled_mlp._intermediate(mlp, x))  # the patch's own rule
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


@contextlib.contextmanager
def _gpu_folds(live: LiveBytes):
    """TRL's tile folds as the GPU runs them (NOTE [What the simulation models]); restored on exit."""
    from trl.kernels import chunked_logprob

    saved = {name: vars(chunked_logprob)[name] for name in ("_forward_tile", "_backward_tile")
             if name in vars(chunked_logprob)}  # a TRL without them: its torch ops are counted as they run

    def in_place(fold):
        def run(*args, **kwargs):
            with live.uncounted():
                return fold(*args, **kwargs)
        return run

    for name, fold in saved.items():
        setattr(chunked_logprob, name, in_place(fold))
    try:
        yield
    finally:
        for name, fold in saved.items():
            setattr(chunked_logprob, name, fold)


def _loss(model, ids: torch.Tensor, fused_head: bool) -> torch.Tensor:
    if not fused_head:
        return model(input_ids=ids, labels=ids).loss  # transformers' own: logits, their float32 upcast, the loss
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    base = model.get_base_model()
    hidden = base.base_model(input_ids=ids).last_hidden_state  # the decoder (Llama's model, GPT-NeoX's gpt_neox)
    head = base.get_output_embeddings()
    out = ChunkedLogProbFunction.apply(hidden[0, :-1], head.weight, head.bias, ids[0, 1:], 1.0,
                                       _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",))
    return -out[0].mean()


@contextlib.contextmanager
def _phases(model, live: LiveBytes):
    """Where the step is, for the peak: "layer" while a decoder layer's parts run (forward or recompute), "head"
    from the end of the last layer's forward (the final norm, LM head and loss, and their backward, come before any
    recompute)."""
    layers = _decoder_layers(model)

    def enter(module, args):
        live.phase = "layer"

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


def activation_run(config, seq: int, features: Features, *, layers: int, lora_r: int = 16,
                   dtype=torch.bfloat16) -> LiveBytes:
    """One forward + backward of ``layers`` layers at ``seq`` tokens; its ``LiveBytes`` (peaks, peak phase)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if features.fused_head and not fused_head_available():
        raise ImportError("ddp_patches.memsim: the fused head runs TRL's chunked head (trl.kernels."
                          "ChunkedLogProbFunction); this TRL has none: upgrade TRL (1.16 has it)")
    model = build(_config(config), layers=layers, lora_r=lora_r, dtype=dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        _materialise(model)
        ids = torch.zeros(1, seq, dtype=torch.long)
        live = LiveBytes()
        live.exclude([*model.parameters(), *model.buffers(), ids])
        with contextlib.ExitStack() as stack:
            stack.enter_context(_phases(model, live))
            if features.offload:
                stack.enter_context(_offloading(model, live))
            if features.tiled_mlp:
                stack.enter_context(_tiling(model))
            if features.fused_head:
                stack.enter_context(_gpu_folds(live))
            with live:
                _loss(model, ids, features.fused_head).backward()
    return live


def activation_peak(config, seq: int, features: Features, *, layers: int, lora_r: int = 16,
                    dtype=torch.bfloat16) -> tuple[int, int]:
    """(device, host) peak bytes created in one forward + backward of ``layers`` layers at ``seq`` tokens."""
    live = activation_run(config, seq, features, layers=layers, lora_r=lora_r, dtype=dtype)
    return live.peak["device"], live.peak["host"]


PROBE_LAYERS = (3, 4)  # the per-layer increment is measured between these (offload keeps the first and last)


def simulate(config, seq: int, features: Features = Features(), *, lora_r: int = 16, layers: int | None = None,
             dtype=torch.bfloat16) -> Step:
    """One training step of ``config``'s causal LM at ``seq`` tokens (batch 1), LoRA r=``lora_r``: a simulation.

    With more layers than ``PROBE_LAYERS``, the activation peak is the one of 4 layers plus what each further layer
    adds (measured between 3 and 4 layers: a checkpointed layer keeps only its input, on the device or the host).
    """
    config = _config(config)
    total = layers or _text_config(config).num_hidden_layers
    small, large = PROBE_LAYERS
    if total <= large:
        run = activation_run(config, seq, features, layers=total, lora_r=lora_r, dtype=dtype)
        act, host, per_layer = run.peak["device"], run.peak["host"], 0
    else:
        few = activation_run(config, seq, features, layers=small, lora_r=lora_r, dtype=dtype)
        run = activation_run(config, seq, features, layers=large, lora_r=lora_r, dtype=dtype)
        per_layer = run.peak["device"] - few.peak["device"]
        act = run.peak["device"] + (total - large) * per_layer
        host = run.peak["host"] + (total - large) * (run.peak["host"] - few.peak["host"])
    weights, lora = static_bytes(config, layers=total, lora_r=lora_r, dtype=dtype)
    return Step(seq=seq, layers=total, weights=weights, lora=lora, activations=act, host=host, per_layer=per_layer,
                peak_in=run.peak_phase)


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
