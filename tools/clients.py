"""Offline assets for running other people's training scripts unchanged (TRL's sft.py, dpo.py, grpo.py).

``build_assets(root)`` writes what those scripts load by path: a tiny random Qwen2 with its tokenizer
(``root/model``) and JSONL dataset folders (``root/data/{sft,dpo,grpo}``). Nothing is downloaded. The GRPO
script imports reward functions by dotted path: ``tools.clients.length_reward`` (the repository root on the path).
"""

from __future__ import annotations

import json
import os
import random

WORDS = [f"w{i}" for i in range(40)]
SPECIALS = ["<pad>", "<eos>", "<unk>", "<bos>"]


def tokenizer():
    """A byte-level BPE trained in memory on the dataset's words, with pad/eos/bos and a minimal chat template.

    Byte-level BPE, because AutoTokenizer loads a qwen2 model's tokenizer as Qwen2Tokenizer, which rebuilds a
    byte-level pipeline around the saved vocabulary (a word-level vocabulary then encodes every text as nothing).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<bos>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}{% endif %}")
    return fast


def build_model_dir(path: str, layers: int = 2) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tokenizer()
    config = AutoConfig.for_model(
        "qwen2", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _write_jsonl(folder: str, rows: list[dict]) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return folder


def build_datasets(root: str, rows: int = 32, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    sft = [{"text": _sentence(rng, rng.randint(6, 14))} for _ in range(rows)]
    dpo = [{"prompt": _sentence(rng, 4), "chosen": _sentence(rng, 5), "rejected": _sentence(rng, 3)}
           for _ in range(rows)]
    grpo = [{"prompt": _sentence(rng, rng.randint(3, 6))} for _ in range(rows)]
    chat = [{"messages": [{"role": "user", "content": _sentence(rng, 6)},
                          {"role": "assistant", "content": _sentence(rng, 6)}]} for _ in range(rows)]
    return {name: _write_jsonl(os.path.join(root, name), data)
            for name, data in (("sft", sft), ("dpo", dpo), ("grpo", grpo), ("chat", chat))}


def build_assets(root: str) -> dict[str, str]:
    """The model folder and the dataset folders, under ``root``."""
    paths = {"model": build_model_dir(os.path.join(root, "model"))}
    paths.update(build_datasets(os.path.join(root, "data")))
    return paths


def length_reward(completions, **kwargs) -> list[float]:
    """A reward for GRPO that needs no model: longer completions score higher (capped)."""
    texts = [c if isinstance(c, str) else " ".join(m.get("content", "") for m in c) for c in completions]
    return [min(len(t.split()), 8) / 8.0 for t in texts]
