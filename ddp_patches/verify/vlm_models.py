"""Tiny random-init vision-language models with LoRA, synthetic images, built offline from configs."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 96
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 90, 91, 92, 93
TEXT_TOKENS = 8
PATCH, TEMPORAL_PATCH, MERGE = 4, 2, 2
GRID = (1, 4, 4)  # t, h, w in patches: 16 patches, 4 tokens after the 2x2 merge
LORA_TEXT = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
LORA_TEXT_AND_VISION = r".*(language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)|visual.*\.(qkv|proj|fc1|fc2))"


def qwen2_vl_config():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=1, pad_token_id=0,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=PATCH,
            spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH, in_channels=3,
        ),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )


def build_qwen2_vl_lora(ckpt_kwargs: Any = None, *, lora_on_vision: bool = False, dtype=torch.float32):
    """Qwen2-VL with checkpointing enabled (``ckpt_kwargs`` as users pass it) and LoRA on the text tower."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration._from_config(qwen2_vl_config(), attn_implementation="eager").to(dtype)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    targets = LORA_TEXT_AND_VISION if lora_on_vision else LORA_TEXT
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    model.train()
    return model


def qwen2_vl_example(seed: int, *, image: bool = True) -> dict:
    """One training example: vision start, the image's tokens, vision end, then text; labels = input_ids."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, 80, (TEXT_TOKENS,), generator=g)
    if not image:
        ids = torch.cat([text, torch.randint(1, 80, (6,), generator=g)])
        return {"input_ids": ids, "labels": ids.clone()}
    patches = GRID[0] * GRID[1] * GRID[2]
    tokens = patches // (MERGE * MERGE)
    ids = torch.cat([torch.tensor([VISION_START]), torch.full((tokens,), IMAGE_TOKEN), torch.tensor([VISION_END]), text])
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "pixel_values": torch.randn(patches, 3 * TEMPORAL_PATCH * PATCH * PATCH, generator=g),
        "image_grid_thw": torch.tensor([GRID]),
    }


def collate_qwen2_vl(examples: list[dict]) -> dict:
    """Stack ids/labels; concatenate the images' patches (Qwen vision inputs are 2-D: patches x features)."""
    batch = {k: torch.stack([e[k] for e in examples]) for k in ("input_ids", "labels")}
    batch["mm_token_type_ids"] = (batch["input_ids"] == IMAGE_TOKEN).long()
    with_image = [e for e in examples if "pixel_values" in e]
    if with_image:
        batch["pixel_values"] = torch.cat([e["pixel_values"] for e in with_image])
        batch["image_grid_thw"] = torch.cat([e["image_grid_thw"] for e in with_image])
    return batch


class ExampleList(torch.utils.data.Dataset):
    """Pre-built feature dicts; the Trainer hands them to the collator as they are."""

    def __init__(self, examples: list[dict]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return self.examples[i]


def qwen2_vl_dataset(n: int = 16) -> ExampleList:
    return ExampleList([qwen2_vl_example(i) for i in range(n)])


def qwen2_vl_batch(rank: int, it: int, micro: int, rows: int = 2) -> dict:
    """Each rank's micro-batch: ``rows`` image+text examples (same length everywhere, so loss means agree)."""
    return collate_qwen2_vl([qwen2_vl_example(100_000 * rank + 1000 * it + 10 * micro + i) for i in range(rows)])


def combine_qwen2_vl(batches: list[dict]) -> dict:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def qwen2_vl_parity(ckpt_kwargs: Any = None, *, lora_on_vision: bool = False, ddp_kwargs: dict | None = None,
                    accum: int = 1, iters: int = 2, reference_context=None):
    import contextlib

    from .hf_models import lm_loss
    from .parity import run_parity

    return run_parity(
        lambda: build_qwen2_vl_lora(ckpt_kwargs, lora_on_vision=lora_on_vision, dtype=torch.float64),
        lambda r, i, m: {k: (v.double() if v.is_floating_point() else v) for k, v in qwen2_vl_batch(r, i, m).items()},
        combine_qwen2_vl,
        lm_loss,
        ddp_kwargs=ddp_kwargs,
        accum=accum,
        iters=iters,
        lr=0.5,
        reference_context=reference_context or contextlib.nullcontext,
    )
