"""Every image-text-to-text family of the installed transformers, built tiny, fed synthetic pixels, trained.

The config is the family's defaults shrunk (``ddp_patches.verify.tiny``). The image input is found by trying the
layouts vision towers take (``[N, C, S, S]`` images, Qwen-style patches with ``image_grid_thw``, Idefics-style
nested, any-res tiles) through the model's ``get_image_features``, which also gives the placeholder count; no
image processor or tokenizer. A family no layout trains is "not buildable", with the last error. The Trainer
scenario: LoRA on all linear layers of both towers, checkpointing on, rank 1 text-only, accumulation 2.
Run by ``python -m tools.compat``; ``tests/test_sweeps.py`` re-measures it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from ddp_patches.verify import tiny

TEXT_TOKENS = 8
MAX_IMAGE_TOKENS = 256


@dataclass
class ImageRecipe:
    """How one family takes an image: the tensors besides input_ids, and the placeholder tokens needed."""

    layout: str
    image_token: int
    tokens: int
    pixels: dict = field(default_factory=dict)  # name -> tensor for one image (batch dim first)
    token_type_keys: tuple[str, ...] = ()
    special_ids: frozenset[int] = frozenset()  # every *_token_id / *_token_index of the config: not text
    plain_token: int = 3  # one id that is none of them

def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def build(model_type: str, dtype=torch.float32):
    return tiny.build(model_type, "AutoModelForImageTextToText").to(dtype)


def _vision_config(config):
    return getattr(config, "vision_config", None) or config


def _image_token(config) -> int | None:
    for c in (config, getattr(config, "text_config", None)):
        for key in ("image_token_id", "image_token_index", "image_token"):
            value = getattr(c, key, None)
            if isinstance(value, int):
                return value
    return None


def _layouts(config, generator: torch.Generator) -> list[tuple[str, dict]]:
    vision = _vision_config(config)
    size = getattr(vision, "image_size", 16)
    size = size[0] if isinstance(size, (list, tuple)) else (size if isinstance(size, int) else 16)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    patch = getattr(vision, "patch_size", 4) or 4
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    temporal = getattr(vision, "temporal_patch_size", None) or 1
    merge = getattr(vision, "spatial_merge_size", None) or 1
    side = 2 * merge  # patches per side: a multiple of the merge size
    return [
        ("image", {"pixel_values": torch.randn(1, channels, size, size, generator=generator),
                   "image_sizes": torch.tensor([[size, size]])}),
        ("patches", {"pixel_values": torch.randn(side * side, channels * temporal * patch * patch,
                                                 generator=generator),
                     "image_grid_thw": torch.tensor([[1, side, side]])}),
        ("nested", {"pixel_values": torch.randn(1, 1, channels, size, size, generator=generator),
                    "image_sizes": torch.tensor([[size, size]])}),
        # any-res (LLaVA-NeXT): the base image plus one tile of the only grid pinpoint
        ("tiles", {"pixel_values": torch.randn(1, 2, channels, size, size, generator=generator),
                   "image_sizes": torch.tensor([[size, size]])}),
    ]


def _count_rows(features: Any) -> int:
    if isinstance(features, torch.Tensor):
        return features.reshape(-1, features.shape[-1]).shape[0] if features.dim() > 1 else 0
    if hasattr(features, "pooler_output") and features.pooler_output is not None:
        return _count_rows(features.pooler_output)
    if isinstance(features, dict) or hasattr(features, "values"):
        features = list(features.values())
        return _count_rows(features[0]) if features else 0
    if isinstance(features, (list, tuple)):
        return sum(_count_rows(f) for f in features if isinstance(f, torch.Tensor))
    return 0


def recipe(model) -> ImageRecipe:
    """The first image layout for which ``get_image_features`` runs and a forward with labels works on a batch of
    two image examples (the Trainer's per-device batch)."""
    config = model.config
    token = _image_token(config)
    if token is None:
        raise ValueError("no image_token_id / image_token_index in the config")
    get_features = getattr(model, "get_image_features", None) or getattr(model.model, "get_image_features", None)
    if get_features is None:
        raise ValueError("the model has no get_image_features to count an image's tokens with")
    takes = set(inspect.signature(model.forward).parameters)
    accepted = set(inspect.signature(get_features).parameters)
    special = _special_ids(config)
    plain = next(i for i in range(3, tiny.VOCAB) if i not in special)
    errors = []
    g = torch.Generator().manual_seed(0)
    for layout, pixels in _layouts(config, g):
        if "image_grid_thw" in pixels and "image_grid_thw" not in accepted:
            continue
        pixels = {k: v for k, v in pixels.items() if k == "pixel_values" or k in accepted}
        try:
            with torch.no_grad():
                tokens = _count_rows(get_features(**pixels))
            if not 0 < tokens <= MAX_IMAGE_TOKENS:
                raise ValueError(f"an image gives {tokens} feature rows")
            candidate = ImageRecipe(layout, token, tokens, pixels,
                                    tuple(k for k in ("token_type_ids", "mm_token_type_ids") if k in takes),
                                    special, plain)
            batch = collate([example(candidate, i, vocab=_vocab(config)) for i in range(2)], candidate)
            with torch.no_grad():
                loss = model(**batch).loss
            if loss is None or not torch.isfinite(loss):
                raise ValueError(f"loss {loss}")
            return candidate
        except Exception as exc:  # noqa: BLE001 - the reason goes into the table
            errors.append(f"{layout}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    raise ValueError("; ".join(errors) or "no image layout matches get_image_features")


def _special_ids(config) -> frozenset[int]:
    configs = [config, *(getattr(config, k, None) for k in tiny.SUB_CONFIGS)]
    return frozenset(v for c in configs if c is not None for k, v in c.to_dict().items()
                     if k.endswith(("_token_id", "_token_index")) and isinstance(v, int))


def _vocab(config) -> int:
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "vocab_size", tiny.VOCAB) or tiny.VOCAB)


def example(recipe_: ImageRecipe, seed: int, *, image: bool = True, vocab: int = tiny.VOCAB) -> dict:
    """Placeholders then text (labels = input_ids, placeholders masked); a text-only example has the same
    length. Text tokens avoid the config's special ids (the top of the tiny vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, min(vocab, tiny.VOCAB) - 12, (TEXT_TOKENS + recipe_.tokens,), generator=g)
    text[torch.isin(text, torch.tensor(sorted(recipe_.special_ids)))] = recipe_.plain_token
    if not image:
        return {"input_ids": text, "labels": text.clone()}
    ids = torch.cat([torch.full((recipe_.tokens,), recipe_.image_token), text[:TEXT_TOKENS]])
    labels = ids.clone()
    labels[: recipe_.tokens] = -100
    out = {"input_ids": ids, "labels": labels}
    out.update({k: v.clone() for k, v in recipe_.pixels.items()})
    return out


def collate(examples: list[dict], recipe_: ImageRecipe) -> dict:
    batch = {k: torch.stack([e[k] for e in examples]) for k in ("input_ids", "labels")}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with_image = [e for e in examples if "pixel_values" in e]
    keys = dict.fromkeys(k for e in with_image for k in e if k not in batch)
    for key in keys:
        batch[key] = torch.cat([e[key] for e in with_image])
    for key in recipe_.token_type_keys:
        batch[key] = (batch["input_ids"] == recipe_.image_token).long()
    return batch


class Setup:
    """The Trainer scenario's model and data for one family (``trainer_runs.train(setup=...)``)."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type

    def __call__(self, ckpt_kwargs, *, text_only: bool, dtype=torch.float32):
        from peft import LoraConfig, get_peft_model

        model = build(self.model_type, dtype)
        self.recipe = recipe(model)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        model.train()
        dataset = self.dataset(images=not text_only, vocab=_vocab(model.config))
        return model, dataset, {"data_collator": lambda ex: collate(ex, self.recipe)}

    def dataset(self, n: int = 8, *, images: bool, vocab: int):
        from datasets import Dataset

        rows = [{k: v.tolist() for k, v in example(self.recipe, i, image=images, vocab=vocab).items()}
                for i in range(n)]
        return Dataset.from_list(rows).with_format("torch")


def run_family(model_type: str) -> dict:
    """The VLM Trainer scenario for one family on the current ranks: LoRA (all-linear: text and vision), reentrant
    checkpoint kwargs, rank 1 text-only, accumulation 2, tiled MLP and (CPU-path) offload on. One row."""
    import ddp_patches
    from ddp_patches import tiled_mlp
    from ddp_patches.offload import offloader as offload

    from ddp_patches.verify.cpu_offload import cpu_path_offloader
    from ddp_patches.verify.trainer_runs import train

    setup = Setup(model_type)
    forced = cpu_path_offloader()
    try:
        with ddp_patches.patched(offload=True, tiled_mlp=True, tiled_mlp_shard_tokens=4), offload.use_offloader(forced):
            result = train("trainer", family=model_type, setup=setup, ckpt_kwargs={"use_reentrant": True},
                           text_only_rank=1, accum=2, steps=2)
            tiled = tiled_mlp.counts()["tiled_calls"]
    except Exception as exc:  # noqa: BLE001 - the row says why
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        stage = "not buildable" if getattr(setup, "recipe", None) is None else "fails"
        return {"family": model_type, "status": stage, "detail": message}
    ok = result["finite"] and result["lora_in_sync"] and result["steps"] == 2
    detail = (f"image: {setup.recipe.layout}, {setup.recipe.tokens} tokens; loss {result['train_loss']:.3f}; "
              f"tiled MLP calls {tiled}")
    return {"family": model_type, "status": "trains" if ok else "fails",
            "detail": detail if ok else f"finite={result['finite']} in_sync={result['lora_in_sync']}"}
