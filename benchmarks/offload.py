"""Peak GPU memory and step time of non-reentrant checkpointing with vs without checkpoint-input offload.

    python benchmarks/offload.py                     # Qwen2-0.5B-sized random model, LoRA, bf16, 4K/8K/16K
    python benchmarks/offload.py --seq 8192 --steps 6
    python benchmarks/offload.py --smoke             # tiny model on CPU: checks the script, measures nothing

Both configurations run in this one process, alternating step by step (off, on, off, on, ...) after a warm-up, so
clock and thermal drift hit both alike. Offload is forced on in a single process with an injected gate (the
library only offloads when distributed; DDP itself does not change activation memory). Targets, from the
offload issue: at least 95% of (layers - 1) x tokens x hidden x bytes removed from the peak, step time <= 1.03x.
Writes benchmarks/results/offload.json. Without a CUDA device it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ddp_patches  # noqa: E402
from ddp_patches import offload  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
TARGET_REMOVED, TARGET_TIME = 0.95, 1.03


def build(cfg: dict, device: str, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", **cfg)
    attn = "sdpa" if device == "cuda" else "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).to(device)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    model.train()
    return model


def step(model, ids: torch.Tensor, opt, device: str) -> tuple[float, int]:
    """One forward/backward/optimizer step; (seconds, peak bytes allocated during it)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated() - base
    return time.perf_counter() - start, 0


def measure(model, seq: int, steps: int, warmup: int, device: str, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (1, seq), device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    # Offload forced on in one process: the default CUDA predicate, an always-open gate.
    offloader = offload.CheckpointInputOffloader(gate=lambda: True, **(
        {} if device == "cuda" else {"should_offload": lambda t: True, "min_bytes": 0}))
    samples = {"off": [], "on": []}
    peaks = {"off": [], "on": []}
    with ddp_patches.patched():  # offload "auto": inert in one process, so "off" is plain checkpointing
        for i in range(warmup + steps):
            for mode in ("off", "on"):
                if mode == "on":
                    with offload.use_offloader(offloader):
                        t, peak = step(model, ids, opt, device)
                else:
                    t, peak = step(model, ids, opt, device)
                if i >= warmup:
                    samples[mode].append(t)
                    peaks[mode].append(peak)
    return {
        "seq": seq,
        "step_s_off": statistics.median(samples["off"]),
        "step_s_on": statistics.median(samples["on"]),
        "peak_bytes_off": max(peaks["off"]),
        "peak_bytes_on": max(peaks["on"]),
        "offload_stats": offloader.last_step.as_dict() if offloader.last_step else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, 2 steps: checks the script only")
    p.add_argument("--out", default=os.path.join(RESULTS, "offload.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    if args.smoke:
        cfg, device, dtype, seqs, steps, warmup = TINY, "cpu", torch.float32, [64], 1, 1
    elif not torch.cuda.is_available():
        print("benchmarks/offload.py: needs a CUDA GPU (offload moves GPU memory to pinned host memory); skipped")
        return 0
    else:
        cfg, device, dtype, seqs, steps, warmup = QWEN2_05B, "cuda", torch.bfloat16, args.seq, args.steps, args.warmup

    torch.manual_seed(0)
    model = build(cfg, device, dtype)
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    print(f"{'seq':>6} {'peak off GiB':>12} {'peak on GiB':>12} {'mem ratio':>9} {'removed/target':>15} "
          f"{'step off s':>10} {'step on s':>10} {'time ratio':>10}")
    for seq in seqs:
        r = measure(model, seq, steps, warmup, device, cfg["vocab_size"])
        ideal = (layers - 1) * seq * hidden * elem
        r["ideal_removed_bytes"] = ideal
        r["removed_fraction"] = (r["peak_bytes_off"] - r["peak_bytes_on"]) / ideal
        r["mem_ratio"] = r["peak_bytes_on"] / r["peak_bytes_off"] if r["peak_bytes_off"] else None
        r["time_ratio"] = r["step_s_on"] / r["step_s_off"]
        r["meets_targets"] = r["removed_fraction"] >= TARGET_REMOVED and r["time_ratio"] <= TARGET_TIME
        rows.append(r)
        flag = "" if r["meets_targets"] or args.smoke else "  <- misses target"
        print(f"{seq:>6} {r['peak_bytes_off'] / 2**30:>12.3f} {r['peak_bytes_on'] / 2**30:>12.3f} "
              f"{(r['mem_ratio'] or 0):>9.3f} {r['removed_fraction']:>15.3f} {r['step_s_off']:>10.3f} "
              f"{r['step_s_on']:>10.3f} {r['time_ratio']:>10.3f}{flag}", flush=True)
    report = {
        "benchmark": "offload",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": {"config": "qwen2-0.5b-sized" if not args.smoke else "tiny", "layers": layers, "hidden": hidden,
                  "dtype": str(dtype), "lora_r": 16},
        "targets": {"removed_fraction_min": TARGET_REMOVED, "time_ratio_max": TARGET_TIME},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
