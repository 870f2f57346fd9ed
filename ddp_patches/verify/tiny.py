"""Tiny random configs for any transformers family, built offline by shrinking the family's own defaults.

A hand-written config per family is always behind the families users pick, so sweeps build them here: the
family's config class is instantiated with every size-like field it has (hidden size, layers, heads, experts,
MLA ranks, vision depth, ...) set small, sub-configs (text, vision, audio) shrunk the same way, and lists that
follow the layer count (``layer_types``, ``mlp_only_layers``) cut to it. A family whose modeling code needs
more than that fails to build, and the sweep reports the error as its reason; nothing here is tuned to one
family.
"""

from __future__ import annotations

import importlib
from typing import Any

LAYERS = 2
VOCAB = 96
MAX_PARAMS = 3_000_000

# Size-like fields, small but consistent: heads x head_dim == hidden, experts >= top-k, ranks <= hidden.
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "ffn_hidden_size": 64,
    "moe_intermediate_size": 16,
    "expert_intermediate_size": 16,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "n_layer": LAYERS,
    "depth": LAYERS,
    "num_attention_heads": 4,
    "num_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "max_window_layers": LAYERS,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "sliding_window": 64,
    "rotary_dim": 4,
    "num_nextn_predict_layers": 0,
    # vision towers
    "image_size": 16,
    "patch_size": 4,
    "out_hidden_size": 32,
    "projection_dim": 32,
    "vision_output_dim": 32,
    "projector_input_dim": 32,
    "projector_output_dim": 32,
    "mm_tokens_per_image": 4,
}
# The fields above that count layers (set to the requested layer count, not to LAYERS).
LAYER_FIELDS = frozenset({"encoder_layers", "decoder_layers", "num_hidden_layers", "num_layers", "n_layer", "depth",
                          "max_window_layers"})
# Sub-configs shrunk with the same table (composite models: VLMs, audio-text models).
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "language_config", "vision_tower_config",
               "perceiver_config", "qformer_config", "thinker_config", "talker_config")


def config_class(model_type: str):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def shrink(values: dict, *, layers: int = LAYERS) -> dict:
    """The overrides for a config whose defaults are ``values``: each size field it has, and layer lists cut."""
    old_layers = next((values[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "depth")
                       if isinstance(values.get(k), int)), None)
    out = {k: (layers if k in LAYER_FIELDS else v) for k, v in SIZES.items() if k in values and values[k] is not None}
    for k in out:
        if isinstance(values[k], (list, tuple)):  # typed as a list (per-axis patch size, image size)
            out[k] = [out[k]] * len(values[k])
    for key, value in values.items():
        if key in SUB_CONFIGS and isinstance(value, dict):
            out[key] = {**value, **shrink(value, layers=layers)}
        elif isinstance(value, list) and old_layers and len(value) == old_layers and old_layers != layers:
            out[key] = _cut(value, layers)  # per-layer lists: layer_types, mlp_only_layers as flags, ...
        elif key == "image_grid_pinpoints" and isinstance(value, list):  # any-res tiling: one tile of the tiny size
            out[key] = [[SIZES["image_size"], SIZES["image_size"]]]
        elif isinstance(value, dict) and "per_layer" in key:  # per-layer overrides keyed by layer index
            out[key] = {k: v for k, v in value.items() if str(k).isdigit() and int(k) < layers}
        elif key in ("rope_parameters", "rope_scaling") and isinstance(value, dict) and value.get("mrope_section"):
            fraction = value.get("partial_rotary_factor", values.get("partial_rotary_factor")) or 1.0
            out[key] = {**value, "mrope_section": _mrope_sections(value["mrope_section"], fraction)}
        elif key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB:
            out[key] = VOCAB - 1 - len([k for k in out if k.endswith(("_token_id", "_token_index"))])
        elif key in ("mlp_only_layers", "full_attn_idxs", "attn_layer_indices") and isinstance(value, list):
            out[key] = [i for i in value if isinstance(i, int) and i < layers]
    if values.get("num_key_value_heads") == values.get("num_attention_heads") and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # multi-head attention (MLA) stays so
    if "head_dim" in out and "hidden_size" in out and "num_attention_heads" in out:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return out


def _mrope_sections(sections: list[int], rotary_fraction: float = 1.0) -> list[int]:
    """Multimodal rotary sections (t, h, w) summing to half the tiny head_dim's rotary part, in the family's
    proportions."""
    half = int(SIZES["head_dim"] * rotary_fraction) // 2
    raw = [half * s / sum(sections) for s in sections]
    scaled = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)[: half - sum(scaled)]:
        scaled[i] += 1
    return scaled


def _uses_mrope(model_type: str) -> bool:
    """The family's modeling code reads ``mrope_section`` (with a full-size fallback when the config has none)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    if model_type not in CONFIG_MAPPING_NAMES:
        return False
    package = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    except ImportError:
        return False
    with open(module.__file__, encoding="utf-8") as f:
        return "mrope_section" in f.read()


def _cut(per_layer: list, layers: int) -> list:
    """``layers`` entries that keep one of each kind the full list has (a hybrid model keeps an attention
    layer beside its linear-attention ones), in their original order, padded with the first kind."""
    kinds = list(dict.fromkeys(map(repr, per_layer)))[:layers]
    picked = [next(v for v in per_layer if repr(v) == k) for k in kinds]
    return picked + [per_layer[0]] * (layers - len(picked))


def tiny_config(model_type: str, *, layers: int = LAYERS, **extra):
    """The family's config with every size shrunk (eager attention, eager experts for fp64 on CPU)."""
    cls = config_class(model_type)
    defaults = cls().to_dict()
    vision_cls = (getattr(cls, "sub_configs", None) or {}).get("vision_config")
    if "vision_config" in defaults and defaults["vision_config"] is None and isinstance(vision_cls, type):
        defaults["vision_config"] = vision_cls().to_dict()  # a VLM whose default is text-only (Gemma4)
    config = cls(**{**shrink(defaults, layers=layers), **extra})
    configs = [c for c in [config, *(getattr(config, k, None) for k in SUB_CONFIGS)] if c is not None]
    mrope = any(_uses_mrope(t) for t in {model_type, *(getattr(c, "model_type", "") for c in configs)} if t)
    for c in configs:
        if hasattr(c, "tie_word_embeddings"):
            c.tie_word_embeddings = False
        rope = getattr(c, "rope_parameters", None)
        if mrope and isinstance(rope, dict) and "mrope_section" not in rope:
            fraction = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None)) or 1.0
            rope["mrope_section"] = _mrope_sections([16, 24, 24], fraction)  # the modeling code's fallback
    return config


class NotTiny(RuntimeError):
    """The shrunk config still describes a large model: some size field this table does not know."""


def build(model_type: str, auto_class: str = "AutoModelForCausalLM", *, max_params: int = MAX_PARAMS,
          **config_extra):
    """A tiny random model of the family through the given auto class, eager attention and eager experts.

    It is first built on the meta device and counted, so a family with an unknown size field is refused
    (``NotTiny``) instead of allocating a full-size model.
    """
    import torch

    config = tiny_config(model_type, **config_extra)
    with torch.device("meta"):
        count = sum(p.numel() for p in _from_config(auto_class, config).parameters())
    if count > max_params:
        raise NotTiny(f"{model_type}: {count:,} parameters after shrinking (limit {max_params:,}); "
                      "a size field of its config is not in ddp_patches.verify.tiny.SIZES")
    return _from_config(auto_class, config)


def _from_config(auto_class: str, config):
    factory = getattr(importlib.import_module("transformers"), auto_class)
    kwargs = {"attn_implementation": "eager"}
    try:
        return factory.from_config(config, experts_implementation="eager", **kwargs)
    except (TypeError, ValueError) as exc:
        if "experts_implementation" not in str(exc):
            raise
        return factory.from_config(config, **kwargs)
