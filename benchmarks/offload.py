"""Peak GPU memory and step time of non-reentrant checkpointing with vs without checkpoint-input offload.

    python benchmarks/offload.py                     # Qwen2-0.5B-sized random model, LoRA, bf16, 4K/8K/16K
    python benchmarks/offload.py --config gpu-bound  # Llama-8B-shaped layers, 8 of them, bf16, 8K/16K
    python benchmarks/offload.py --seq 8192 --steps 6
    python benchmarks/offload.py --smoke --out-dir /tmp/x   # tiny model on CPU: checks the script, measures nothing

Both configurations run in this one process, alternating step by step (off, on, off, on, ...) after a warm-up, so
clock and thermal drift hit both alike. Offload is forced on in a single process with an injected gate (the
library only offloads when distributed; DDP itself does not change activation memory). Targets, from the
offload issue: at least 95% of the removable bytes, (layers - 1) x tokens x hidden x bytes, moved to the host and
removed from the peak (peak <= baseline - 0.9 x removable), step time <= 1.03x. The gpu-bound configuration is
the one where the CPU runs far ahead of the GPU, so device memory must be released on the GPU's timeline.
Writes benchmarks/results/offload.json and .png. Without a CUDA device it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ddp_patches  # noqa: E402
from ddp_patches import offload  # noqa: E402

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True)
LLAMA_8B_8_LAYERS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                         tie_word_embeddings=False)
CONFIGS = {  # name: (model type, config, default lengths, quick lengths)
    "qwen2-0.5b": ("qwen2", QWEN2_05B, [4096, 8192, 16384], [4096, 8192]),
    "gpu-bound": ("llama", LLAMA_8B_8_LAYERS, [8192, 16384], [8192]),
}
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
NAME = "offload"
TARGET_REMOVED, TARGET_MOVED, TARGET_TIME = 0.9, 0.95, 1.03


def build(cfg: dict, device: str, dtype: torch.dtype, model_type: str = "qwen2"):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **cfg)
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
    # Offload forced on in one process: the default CUDA predicate, an always-open gate, under any engine.
    offloader = offload.CheckpointInputOffloader(gate=lambda: True, engines=None, **(
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


def run(quick: bool = False, *, seqs: list[int] | None = None, steps: int = 5, warmup: int = 2,
        smoke: bool = False, config: str = "qwen2-0.5b") -> dict | None:
    """None (with a message) without a CUDA device, unless ``smoke`` (tiny model on CPU, checks the code)."""
    model_type, cfg, default_seqs, quick_seqs = CONFIGS[config]
    if smoke:
        model_type, cfg, device, dtype, seqs, steps, warmup = "qwen2", TINY, "cpu", torch.float32, [64], 1, 1
    elif not torch.cuda.is_available():
        print("offload: needs a CUDA GPU (it moves GPU memory to pinned host memory); skipped")
        return None
    else:
        device, dtype = "cuda", torch.bfloat16
        seqs = seqs or (quick_seqs if quick else default_seqs)
    torch.manual_seed(0)
    model = build(cfg, device, dtype, model_type)
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for seq in seqs:
        r = measure(model, seq, steps, warmup, device, cfg["vocab_size"])
        ideal = (layers - 1) * seq * hidden * elem
        r["ideal_removed_bytes"] = ideal
        r["removed_fraction"] = (r["peak_bytes_off"] - r["peak_bytes_on"]) / ideal
        moved = (r["offload_stats"] or {}).get("offloaded_bytes", 0)
        r["moved_fraction"] = moved / ideal
        r["mem_ratio"] = r["peak_bytes_on"] / r["peak_bytes_off"] if r["peak_bytes_off"] else None
        r["time_ratio"] = r["step_s_on"] / r["step_s_off"]
        r["misses"] = [] if smoke else [m for m, bad in (
            (f"moved {r['moved_fraction']:.3f} < {TARGET_MOVED}", r["moved_fraction"] < TARGET_MOVED),
            (f"removed {r['removed_fraction']:.3f} < {TARGET_REMOVED}", r["removed_fraction"] < TARGET_REMOVED),
            (f"time {r['time_ratio']:.3f}x > {TARGET_TIME}x", r["time_ratio"] > TARGET_TIME)) if bad]
        rows.append(r)
    return {
        "benchmark": NAME,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "model": {"config": "tiny" if smoke else config, "layers": layers, "hidden": hidden,
                  "dtype": str(dtype), "lora_r": 16},
        "targets": {"moved_fraction_min": TARGET_MOVED, "removed_fraction_min": TARGET_REMOVED,
                    "time_ratio_max": TARGET_TIME},
        "rows": rows,
    }


def print_table(report: dict) -> None:
    print(f"{'seq':>6} {'peak off GiB':>12} {'peak on GiB':>12} {'mem ratio':>9} {'moved/removable':>15} "
          f"{'removed/removable':>17} {'step off s':>10} {'step on s':>10} {'time ratio':>10}")
    for r in report["rows"]:
        flag = ("  <- " + "; ".join(r["misses"])) if r["misses"] else ""
        print(f"{r['seq']:>6} {r['peak_bytes_off'] / 2**30:>12.3f} {r['peak_bytes_on'] / 2**30:>12.3f} "
              f"{(r['mem_ratio'] or 0):>9.3f} {r['moved_fraction']:>15.3f} {r['removed_fraction']:>17.3f} "
              f"{r['step_s_off']:>10.3f} {r['step_s_on']:>10.3f} {r['time_ratio']:>10.3f}{flag}", flush=True)


def plot(report: dict, path: str) -> str:
    from benchmarks._common import plot_pair

    rows = report["rows"]
    x = [r["seq"] for r in rows]
    plot_pair(path, x, {"offload off": [r["peak_bytes_off"] / 2**30 for r in rows],
                        "offload on": [r["peak_bytes_on"] / 2**30 for r in rows]},
              [r["time_ratio"] for r in rows], xlabel="sequence length", ylabel="peak GiB",
              ratio_label="step time on / off", title=f"Offload of checkpoint inputs ({report['device']})",
              logx=True, target=TARGET_TIME)
    return path


def summarize(report: dict) -> list[str]:
    return [f"| offload {report['model']['config']}, seq {r['seq']} ({report['device']}) | "
            f"{r['moved_fraction']:.0%} of removable moved, {r['removed_fraction']:.0%} off the peak, "
            f"{r['time_ratio']:.3f}x time | >= {TARGET_MOVED:.0%}, >= {TARGET_REMOVED:.0%}, <= {TARGET_TIME}x | "
            f"{'missed: ' + '; '.join(r['misses']) if r['misses'] else 'met'} |" for r in report["rows"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="the shorter lengths only")
    p.add_argument("--config", choices=sorted(CONFIGS), default="qwen2-0.5b",
                   help="qwen2-0.5b (default) or gpu-bound (Llama-8B-shaped layers, 8 layers)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, 1 step: checks the script only")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    report = run(args.quick, seqs=args.seq, steps=args.steps, warmup=args.warmup, smoke=args.smoke,
                 config=args.config)
    if report is None:
        return 0
    from benchmarks._common import finish

    finish(sys.modules[__name__], report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
