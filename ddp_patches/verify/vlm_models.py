"""Tiny random-init vision-language models with LoRA, synthetic images, built offline from configs.

One ``VLMSpec`` per family says how to build the config and lay out an example: the image's placeholder tokens
in ``input_ids`` and the ``pixel_values`` (and grid) the vision tower expects. Qwen vision inputs are 2-D
(patches x features) with ``image_grid_thw``; Qwen VLs also take ``mm_token_type_ids`` and Gemma3
``token_type_ids`` (1 on image tokens). Examples without an image are plain text, for the rank that only ever
sees text batches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

VOCAB = 96
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 90, 91, 92, 93
TEXT_TOKENS = 8
PATCH, TEMPORAL_PATCH, MERGE = 4, 2, 2
GRID = (1, 4, 4)  # Qwen: t, h, w in patches -> 16 patches, 4 tokens after the 2x2 merge
IMAGE_SIZE = 16  # Gemma3/Llava/Idefics3: 16x16 pixels, 4x4 patches
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=1, pad_token_id=0)
_TEXT_PROJ = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclass(frozen=True)
class VLMSpec:
    family: str
    model_class: str  # in transformers
    config: Callable[[], Any]
    image_tokens: int  # placeholder tokens per image in input_ids
    pixels: str  # "qwen" (2-D patches + grid), "image" (N,3,H,W), "idefics" (N,1,3,H,W)
    text_tower: str  # attribute path of the text tower under model.model
    lora_vision: str  # regex of the vision tower's linear layers
    token_type_key: str | None = None  # "mm_token_type_ids" / "token_type_ids"
    wrap: tuple[int, int] | None = None  # tokens around the image placeholders

    @property
    def lora_text(self) -> str:
        return rf".*{self.text_tower}.*\.{_TEXT_PROJ}"


def _qwen_vision(**extra):
    return dict(depth=2, num_heads=4, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH,
                in_channels=3, **extra)


def _qwen2_vl():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
                         vision_config=_qwen_vision(embed_dim=32, hidden_size=32, mlp_ratio=2),
                         image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                         vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
                            vision_config=_qwen_vision(hidden_size=32, out_hidden_size=32, intermediate_size=64,
                                                       window_size=16, fullatt_block_indexes=[1]),
                            image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                            vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


def _qwen3_vl():
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    return Qwen3VLConfig(text_config=dict(**_TEXT, head_dim=8, rope_scaling=rope),
                         vision_config=_qwen_vision(hidden_size=32, out_hidden_size=32, intermediate_size=64,
                                                    num_position_embeddings=64, deepstack_visual_indexes=[1]),
                         image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                         vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


def _siglip_like():
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                image_size=IMAGE_SIZE, patch_size=PATCH)


def _gemma3():
    from transformers import Gemma3Config

    return Gemma3Config(text_config=dict(**_TEXT, head_dim=8, sliding_window=16), vision_config=_siglip_like(),
                        mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=VISION_START,
                        eoi_token_index=VISION_END)


def _llava():
    from transformers import LlavaConfig

    return LlavaConfig(text_config=dict(model_type="llama", **_TEXT),
                       vision_config=dict(model_type="clip_vision_model", projection_dim=32, **_siglip_like()),
                       image_token_index=IMAGE_TOKEN, vision_feature_layer=-1, image_seq_length=16)


def _idefics3():
    from transformers import Idefics3Config

    return Idefics3Config(text_config=dict(model_type="llama", **_TEXT), vision_config=_siglip_like(),
                          image_token_id=IMAGE_TOKEN, scale_factor=2)


SPECS = {
    "qwen2_vl": VLMSpec("qwen2_vl", "Qwen2VLForConditionalGeneration", _qwen2_vl, 4, "qwen", "language_model",
                        r".*visual.*\.(qkv|proj|fc1|fc2)", "mm_token_type_ids", (VISION_START, VISION_END)),
    "qwen2_5_vl": VLMSpec("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl, 4, "qwen",
                          "language_model", r".*visual.*\.(qkv|proj|gate_proj|up_proj|down_proj)",
                          "mm_token_type_ids", (VISION_START, VISION_END)),
    "qwen3_vl": VLMSpec("qwen3_vl", "Qwen3VLForConditionalGeneration", _qwen3_vl, 4, "qwen", "language_model",
                        r".*visual.*\.(qkv|proj|linear_fc1|linear_fc2)", "mm_token_type_ids",
                        (VISION_START, VISION_END)),
    "gemma3": VLMSpec("gemma3", "Gemma3ForConditionalGeneration", _gemma3, 4, "image", "language_model",
                      r".*vision_tower.*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)", "token_type_ids",
                      (VISION_START, VISION_END)),
    "llava": VLMSpec("llava", "LlavaForConditionalGeneration", _llava, 16, "image", "language_model",
                     r".*vision_tower.*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)"),
    "idefics3": VLMSpec("idefics3", "Idefics3ForConditionalGeneration", _idefics3, 4, "idefics", "text_model",
                        r".*vision_model.*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)"),
}


def build_vlm(family: str, ckpt_kwargs: Any = None, *, lora_on_vision: bool = False, dtype=torch.float32,
              qlora: bool = False):
    """The family's model with checkpointing enabled (``ckpt_kwargs`` as users pass it) and LoRA on the text
    tower, or on the text and vision towers. ``qlora``: the base is re-loaded through bitsandbytes nf4."""
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    spec = SPECS[family]
    cls = getattr(transformers, spec.model_class)
    model = cls._from_config(spec.config(), attn_implementation="eager").to(dtype)
    if qlora:
        from .hf_models import reload_4bit

        model = prepare_model_for_kbit_training(reload_4bit(model, cls), use_gradient_checkpointing=True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    targets = f"({spec.lora_text}|{spec.lora_vision})" if lora_on_vision else spec.lora_text
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    model.train()
    return model


def vlm_example(family: str, seed: int, *, image: bool = True) -> dict:
    """One example: [start] image placeholders [end] then text; labels = input_ids. Text-only: same length."""
    spec = SPECS[family]
    g = torch.Generator().manual_seed(seed)
    wrap = 2 if spec.wrap else 0
    if not image:
        ids = torch.randint(1, 80, (TEXT_TOKENS + spec.image_tokens + wrap,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    placeholders = [torch.full((spec.image_tokens,), IMAGE_TOKEN)]
    if spec.wrap:
        placeholders = [torch.tensor([spec.wrap[0]]), *placeholders, torch.tensor([spec.wrap[1]])]
    ids = torch.cat([*placeholders, torch.randint(1, 80, (TEXT_TOKENS,), generator=g)])
    example = {"input_ids": ids, "labels": ids.clone()}
    if spec.pixels == "qwen":
        patches = GRID[0] * GRID[1] * GRID[2]
        example["pixel_values"] = torch.randn(patches, 3 * TEMPORAL_PATCH * PATCH * PATCH, generator=g)
        example["image_grid_thw"] = torch.tensor([GRID])
    else:
        example["pixel_values"] = torch.randn(3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    return example


def make_collate(family: str) -> Callable[[list[dict]], dict]:
    spec = SPECS[family]

    def collate(examples: list[dict]) -> dict:
        batch = {k: torch.stack([e[k] for e in examples]) for k in ("input_ids", "labels")}
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])  # TRL's loss accounting needs it
        if spec.token_type_key:
            batch[spec.token_type_key] = (batch["input_ids"] == IMAGE_TOKEN).long()
        with_image = [e for e in examples if "pixel_values" in e]
        if with_image:
            if spec.pixels == "qwen":
                batch["pixel_values"] = torch.cat([e["pixel_values"] for e in with_image])
                batch["image_grid_thw"] = torch.cat([e["image_grid_thw"] for e in with_image])
            elif spec.pixels == "idefics":
                batch["pixel_values"] = torch.stack([e["pixel_values"] for e in with_image]).unsqueeze(1)
            else:
                batch["pixel_values"] = torch.stack([e["pixel_values"] for e in with_image])
        return batch

    return collate


def vlm_dataset(family: str, n: int = 16, *, images: bool = True):
    """Pre-built features in a ``datasets.Dataset`` (TRL requires one), handed out as tensors."""
    from datasets import Dataset

    rows = [{k: v.tolist() for k, v in vlm_example(family, i, image=images).items()} for i in range(n)]
    return Dataset.from_list(rows).with_format("torch")


def vlm_batch(family: str, rank: int, it: int, micro: int, rows: int = 2, *, text_only_rank: int | None = None):
    """A rank's micro-batch (all examples the same length, so mean losses combine exactly)."""
    image = rank != text_only_rank
    return make_collate(family)([vlm_example(family, 100_000 * rank + 1000 * it + 10 * micro + i, image=image)
                                 for i in range(rows)])


def vlm_parity(family: str = "qwen2_vl", ckpt_kwargs: Any = None, *, lora_on_vision: bool = False,
               ddp_kwargs: dict | None = None, accum: int = 1, iters: int = 2,
               reference_context=contextlib.nullcontext, text_only_rank: int | None = None):
    from .hf_models import lm_parity

    def batch(r, i, m):
        b = vlm_batch(family, r, i, m, text_only_rank=text_only_rank)
        return {k: (v.double() if v.is_floating_point() else v) for k, v in b.items()}

    return lm_parity(family, ckpt_kwargs, ddp_kwargs=ddp_kwargs, accum=accum, iters=iters,
                     reference_context=reference_context, batch=batch,
                     build=lambda: build_vlm(family, ckpt_kwargs, lora_on_vision=lora_on_vision, dtype=torch.float64))
