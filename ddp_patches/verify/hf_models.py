"""Tiny random-init Hugging Face causal LMs with PEFT LoRA/QLoRA, built offline from configs."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Any

import torch

VOCAB = 64
SEQ = 12
ROWS = 2
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_UNSET = "unset"  # stands for "gradient_checkpointing_kwargs not passed at all"


def tiny_config(family: str, layers: int = 2):
    from transformers import AutoConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model_type = {"llama": "llama", "qwen2": "qwen2"}[family]
    return AutoConfig.for_model(model_type, **common)


def build_causal_lm(family: str, *, dtype: torch.dtype = torch.float64, qlora: bool = False, layers: int = 2):
    """The base model; with ``qlora`` it is saved and re-loaded through bitsandbytes 4-bit (nf4, fp32 compute)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(family, layers), attn_implementation="eager").to(dtype)
    return reload_4bit(model, AutoModelForCausalLM) if qlora else model


def reload_4bit(model, cls):
    """Save ``model`` and load it back through bitsandbytes 4-bit (nf4, fp32 compute): a QLoRA base."""
    from transformers import BitsAndBytesConfig

    with tempfile.TemporaryDirectory(prefix="ddp_patches_qlora_") as tmp:
        model.save_pretrained(tmp)
        rank0_files_into(tmp)  # NOTE [A saved model reaches every node]
        loaded = cls.from_pretrained(
            tmp,
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
            ),
            dtype=torch.float32,
            attn_implementation="eager",
        )
        _barrier()
    return loaded


# NOTE [A saved model reaches every node]
# Under a process group transformers writes save_pretrained's files on global rank 0 only, and a directory rank 0
# makes lies on rank 0's machine: a rank on another node cannot read it. So every rank saves into a directory of its
# own, and rank 0's files (a tiny model: kilobytes) are broadcast and written into each other rank's, which then
# loads from its own disk; no rank assumes it shares a file system with rank 0.
# Test: tests/test_two_nodes.py::test_two_torchrun_nodes_on_one_machine.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §19
def rank0_files_into(directory: str) -> None:
    """Under a process group, make ``directory`` hold exactly rank 0's files of its own ``directory``, on every
    rank (a collective: every rank calls it)."""
    import os

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    files: list[Any] = [None]
    if dist.get_rank() == 0:
        found = {}
        for top, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(top, name)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, directory)] = f.read()
        files = [found]
    dist.broadcast_object_list(files, src=0)
    if dist.get_rank() != 0:
        shutil.rmtree(directory)  # what this rank may have written itself (transformers 4.x writes on every rank)
        os.makedirs(directory)
        for rel, data in files[0].items():
            path = os.path.join(directory, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)


@contextlib.contextmanager
def _shared_tmpdir():
    """One temporary directory for all ranks of one machine (rank 0 creates and removes it): tests' output dirs."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        with tempfile.TemporaryDirectory(prefix="ddp_patches_qlora_") as tmp:
            yield tmp
        return
    holder = [tempfile.mkdtemp(prefix="ddp_patches_qlora_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    try:
        yield holder[0]
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def build_lora_model(family: str, ckpt_kwargs: Any = None, *, qlora: bool = False, dtype=torch.float64,
                     layers: int = 2):
    """LoRA on every attention/MLP projection, activation checkpointing on with ``ckpt_kwargs``.

    ``ckpt_kwargs`` None / {} / {"use_reentrant": True} are the three ways users reach checkpointing;
    "unset" calls the enable method without the argument. QLoRA goes through
    ``peft.prepare_model_for_kbit_training``, which enables checkpointing itself (with ``{}``, i.e. reentrant).
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = build_causal_lm(family, dtype=dtype if not qlora else torch.float32, qlora=qlora, layers=layers)
    if qlora:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        enable_checkpointing(model, None if ckpt_kwargs == _UNSET else ckpt_kwargs)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    return model


def lm_batch(rank: int, it: int, micro: int, *, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * it + micro + 7)
    ids = torch.randint(1, VOCAB, (ROWS, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def combine_lm(batches: list[dict]) -> dict:
    """The global batch: each key concatenated over the ranks that have it (a text-only rank has no pixels)."""
    keys = dict.fromkeys(k for b in batches for k in b)
    return {k: torch.cat([b[k] for b in batches if k in b]) for k in keys}


def lm_loss(model, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def lm_parity(family: str, ckpt_kwargs: Any = None, *, qlora: bool = False, ddp_kwargs: dict | None = None,
              accum: int = 1, iters: int = 2, reference_context=contextlib.nullcontext, wrap=None, build=None,
              batch=lm_batch):
    """Parity of a LoRA language model: ``build`` (default: ``build_lora_model``) on ``batch(rank, it, micro)``
    (default: ``lm_batch``), mean token loss, the ranks' batches concatenated for the reference."""
    from .parity import DDP, run_parity

    return run_parity(
        build or (lambda: build_lora_model(family, ckpt_kwargs, qlora=qlora)),
        batch,
        combine_lm,
        lm_loss,
        ddp_kwargs=ddp_kwargs,
        accum=accum,
        iters=iters,
        lr=0.5,
        reference_context=reference_context,
        wrap=wrap or DDP,
    )


def word_level_tokenizer():
    """A tokenizer built in memory (no download): one token per word of a small vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def lm_dataset(n: int = 16, seq: int = SEQ, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, seq), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def enable_checkpointing(model, kwargs: dict | None = None) -> None:
    """Checkpointing on through whichever name this transformers has: ``activation_checkpointing_enable``
    (5.2x) or ``gradient_checkpointing_enable`` (4.x and early 5.x, e.g. the 5.17 on the GPU machine).
    ``kwargs=None`` leaves the library's default checkpoint kwargs."""
    if hasattr(model, "activation_checkpointing_enable"):
        enable, key = model.activation_checkpointing_enable, "activation_checkpointing_kwargs"
    else:
        enable, key = model.gradient_checkpointing_enable, "gradient_checkpointing_kwargs"
    enable() if kwargs is None else enable(**{key: kwargs})
