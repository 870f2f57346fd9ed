"""The model a simulation runs: a transformers config read from a file, a folder or a dict, built on the meta device
with LoRA by PEFT (its decoder cut to a few layers), its static bytes (bf16 or NF4 weights, LoRA, optimizer), and
the fake-tensor copy each run reuses (NOTE [The k-bit preparation's float32])."""

from __future__ import annotations

import torch

from ..verify.hf_models import enable_checkpointing


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
    enable_checkpointing(model, {"use_reentrant": False})  # the name this transformers has, no FutureWarning
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
