"""Short HF Trainer / TRL SFTTrainer runs on CPU (gloo) with a tiny LoRA model, as users launch them."""

from __future__ import annotations

import math
import os
import tempfile

import torch
import torch.distributed as dist

from . import moe_models, vlm_models
from .device import device
from .hf_models import build_lora_model, lm_dataset, word_level_tokenizer
from .parity import params_equal_across_ranks


def train(
    kind: str = "trainer",
    *,
    family: str = "llama",
    ckpt_kwargs: dict | None = None,
    static_graph: bool | None = None,
    find_unused: bool | None = None,
    accum: int = 2,
    steps: int = 3,
    qlora: bool = False,
    layers: int = 2,
    lora_on_vision: bool = False,
    text_only_rank: int | None = None,
    args_extra: dict | None = None,
    setup=None,
) -> dict:
    """Run ``steps`` optimizer steps; return final loss, whether it is finite, and LoRA equality across ranks.

    Checkpointing is enabled through the training arguments (``gradient_checkpointing=True`` with
    ``ckpt_kwargs``), the way users do it; ``find_unused``/``static_graph`` are the ddp_* arguments, None
    meaning not set. ``args_extra``: more training arguments (``torch_compile=True``, ...).
    """
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    extra: dict = {}
    vlm = family in vlm_models.SPECS or setup is not None
    # The process group may not exist yet (TrainingArguments creates it): the rank comes from torchrun's env.
    text_only = text_only_rank is not None and int(os.environ.get("RANK", "0")) == text_only_rank
    if setup is not None:
        model, dataset, extra = setup(ckpt_kwargs, text_only=text_only)
    elif vlm:
        model = vlm_models.build_vlm(family, ckpt_kwargs, lora_on_vision=lora_on_vision, qlora=qlora)
        dataset = vlm_models.vlm_dataset(family, images=not text_only)
        extra = {"data_collator": vlm_models.make_collate(family)}
    elif family in moe_models.FAMILIES:
        model = moe_models.build_moe_lora(family, ckpt_kwargs, dtype=torch.float32)
        dataset = lm_dataset()
    else:
        model = build_lora_model(family, ckpt_kwargs, qlora=qlora, dtype=torch.float32, layers=layers)
        dataset = lm_dataset()
    common = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accum,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=device().type == "cpu",
        bf16=False,
        fp16=False,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=ckpt_kwargs,
        ddp_find_unused_parameters=find_unused,
        ddp_static_graph=static_graph,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=not vlm,
        **(args_extra or {}),
    )
    with tempfile.TemporaryDirectory(prefix="ddp_patches_train_") as out:
        if kind == "trainer":
            args = TrainingArguments(output_dir=out, **common)
            trainer = Trainer(model=model, args=args, train_dataset=dataset, **extra)
        elif kind == "sft":
            from trl import SFTConfig, SFTTrainer

            sft_extra = {"dataset_kwargs": {"skip_prepare_dataset": True}} if vlm else {}
            args = SFTConfig(output_dir=out, **common, max_length=None, packing=False, **sft_extra)
            trainer = SFTTrainer(
                model=model, args=args, train_dataset=dataset, processing_class=word_level_tokenizer(), **extra
            )
        else:
            raise ValueError(f"kind must be 'trainer' or 'sft', got {kind!r}")
        result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ddp = trainer.model_wrapped
    return {
        "train_loss": float(result.training_loss),
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses + [result.training_loss]),
        "steps": trainer.state.global_step,
        "lora_in_sync": params_equal_across_ranks(trainer.model),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "ddp": {
            "find_unused_parameters": getattr(ddp, "find_unused_parameters", None),
            "static_graph": getattr(ddp, "static_graph", None),
        },
    }
