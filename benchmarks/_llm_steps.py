"""Worker for the step-cost benchmarks: a small random-init Llama with LoRA and activation checkpointing, trained
for a few steps on each rank under several DDP configurations at once, interleaved step by step.

Configurations (all on the same data, the same initial weights):
  unpatched   the best configuration that works without the library: non-reentrant checkpointing,
              find_unused_parameters=False. Built before apply(); its steps run with the offload wrapper's
              pass-through only (one ``yield from`` per checkpoint call).
  patched     apply() with DDP's defaults: reentrant kwargs (run non-reentrant under DDP),
              find_unused_parameters unset (kept False), the unused-parameter bookkeeping and the trainable-set
              guard.
  patched-fu-true  the same with find_unused_parameters=True (what the Trainer passes for a PeftModel, and what
              the last release forced): this / patched = the cost of DDP's own search for unused parameters.
In a single process (world size 1) DDP is not used: every configuration is the plain model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ("unpatched", "patched", "patched-fu-true")


def build(ckpt_kwargs: dict, hidden: int, layers: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                  max_position_embeddings=4096, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    model.config.use_cache = False
    lora = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    model.train()
    return model


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_patches
    from ddp_patches import offload

    from benchmarks._common import leave_group, peak_bytes

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    wrap = (lambda m, **kw: DDP(m, **kw)) if world > 1 else (lambda m, **kw: m)

    models = {"unpatched": wrap(build({"use_reentrant": False}, args.hidden, args.layers),
                                find_unused_parameters=False)}
    ddp_patches.apply()
    models["patched"] = wrap(build({"use_reentrant": True}, args.hidden, args.layers))
    models["patched-fu-true"] = wrap(build({"use_reentrant": True}, args.hidden, args.layers),
                                     find_unused_parameters=True)
    optims = {k: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-3) for k, m in models.items()}

    def step(name, ids):
        ctx = offload.use_offloader(None) if name == "unpatched" else _null()
        with ctx:
            models[name](input_ids=ids, labels=ids).loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)

    rows = []
    for seq in args.seqs:
        g = torch.Generator().manual_seed(1000 + rank)
        ids = torch.randint(0, 512, (args.batch, seq), generator=g)
        times = {k: [] for k in CONFIGS}
        for i in range(args.warmup + args.rounds):
            order = CONFIGS if i % 2 == 0 else tuple(reversed(CONFIGS))  # neither goes first every time
            for name in order:
                start = time.perf_counter()
                step(name, ids)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        peaks = {name: peak_bytes(lambda name=name: step(name, ids)) for name in CONFIGS} if args.memory else {}
        row = {"seq": seq, "world": world, "median_s": {k: statistics.median(v) for k, v in times.items()},
               "all_s": times, "peak_bytes": peaks}
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        rows.append(gathered)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    ddp_patches.revert()
    models.clear()
    optims.clear()
    leave_group()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker-out", required=True)
    p.add_argument("--seqs", type=int, nargs="+", default=[256])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--memory", action="store_true")
    worker(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
