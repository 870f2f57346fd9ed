"""Peak GPU memory and step time of non-reentrant checkpointing with vs without checkpoint-input offload.

    python benchmarks/offload.py                     # Qwen2-0.5B-sized random model, LoRA, bf16, 4K/8K/16K
    python benchmarks/offload.py --config gpu-bound  # Llama-8B-shaped layers, 8 of them, bf16, 8K/16K
    python benchmarks/offload.py --seq 8192 --steps 6
    python benchmarks/offload.py --smoke --out-dir /tmp/x   # tiny model on CPU: checks the script, measures nothing

Each mode runs in a process of its own (``--worker``), so the two never share the caching allocator's reserved
pool; the parent runs off, on, off, on (two processes per mode) and takes the median step time over both.
Offload is forced on in a single process with an injected gate (the library only offloads when distributed;
DDP itself does not change activation memory).

What is measured, per mode: the peak of ACTIVE bytes (``active_bytes.all.peak``: allocated plus freed blocks the
allocator cannot reuse yet -- what the next allocation competes with; ``memory_allocated`` drops at ``free()`` even
while a block is still owed to another stream, which is how an earlier version of this benchmark missed that
nothing was released), the allocated peak, the reserved peak, ``num_alloc_retries``, the median step time, the
first step's time and offload's own stats (``stall_ms``: GPU time the compute stream waited for copies in). The
first step pins the pool's buffers: "on" pins them ahead on a background thread (NOTE [Pinning ahead] in
ddp_patches/offload/pinned_pool.py), and one more process per repetition, "on-lazy", pins them inside the packs as before;
``first_step_s_on`` and ``first_step_s_on_lazy`` are the two figures (with ``pin_ms``, the time pinned inside
the forward, and ``prepinned``, the buffers pinned ahead, from step 1's stats).

Targets, and the arithmetic behind them. With L checkpointed layers of S tokens x H hidden at b bytes, the
inputs are L tensors of S*H*b bytes. Two can never move: PEFT makes the first layer's input a leaf that
requires grad (``enable_input_require_grads``), and the last is still on the device when backward asks for it
(it would be copied out and straight back). So at most (L-2)*S*H*b can move ("movable"):
  * moved >= 0.95 x movable;
  * active peak drop >= 0.9 x (moved - prefetch_depth x S*H*b): the peak falls in early backward, when the
    input prefetched for the next layer is already back;
  * step time on/off <= 1.03x.
Writes benchmarks/results/offload.json and .png. Without a CUDA device it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ddp_patches  # noqa: E402
from ddp_patches.offload import offloader as offload  # noqa: E402

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
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(cfg: dict, device: str, dtype: torch.dtype, model_type: str = "qwen2"):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddp_patches.verify.hf_models import enable_checkpointing

    config = AutoConfig.for_model(model_type, **cfg)
    attn = "sdpa" if device == "cuda" else "eager"
    with torch.device(device):  # initialised where it runs: an 8B-shaped init on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    enable_checkpointing(model, {"use_reentrant": False})
    model.config.use_cache = False
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    model.train()
    return model


MODES = ("off", "on", "on-lazy")  # on-lazy: offload on, buffers pinned inside the packs (no pinning ahead)


def one_mode(config: str, seq: int, mode: str, steps: int, warmup: int, smoke: bool = False) -> dict:
    """One process's measurement of one mode (``--worker``)."""
    model_type, cfg, _, _ = CONFIGS[config]
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    if smoke:
        model_type, cfg = "qwen2", TINY
    torch.manual_seed(0)
    model = build(cfg, device, dtype, model_type)
    ids = torch.randint(0, cfg["vocab_size"], (1, seq), device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    # Offload forced on in one process: the default CUDA predicate, an always-open gate, under any engine.
    offloader = offload.CheckpointInputOffloader(
        gate=lambda: True, engines=None, measure_stalls=not smoke, prepin_ahead=0 if mode == "on-lazy" else None,
        **({"should_offload": lambda t: True, "min_bytes": 0} if smoke else {}))
    on = mode != "off"
    cuda = device == "cuda"
    times, peaks, first = [], [], None
    with ddp_patches.patched(offload=True):
        with offload.use_offloader(offloader if on else None):
            for i in range(warmup + steps):
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_stats()
                start = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                if first is None and offloader.last_step is not None:  # step 1's window ends at step 2's first pack
                    first = offloader.last_step.as_dict()
                if cuda and i >= warmup:
                    now = torch.cuda.memory_stats()
                    peaks.append({"active": now["active_bytes.all.peak"] - base["active_bytes.all.current"],
                                  "allocated": now["allocated_bytes.all.peak"] - base["allocated_bytes.all.current"],
                                  "reserved": now["reserved_bytes.all.peak"]})
    stats = offloader.last_step.as_dict() if offloader.last_step else None
    return {
        "mode": mode, "seq": seq, "first_step_s": times[0], "step_s": statistics.median(times[warmup:]),
        "active_peak": max((p["active"] for p in peaks), default=0),
        "allocated_peak": max((p["allocated"] for p in peaks), default=0),
        "reserved_peak": max((p["reserved"] for p in peaks), default=0),
        "num_alloc_retries": torch.cuda.memory_stats()["num_alloc_retries"] if cuda else 0,
        "offload_stats": stats if on else None,
        "first_step_stats": first if on else None,
    }


def spawn_mode(config: str, seq: int, mode: str, steps: int, warmup: int, smoke: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--config", config, "--seq", str(seq),
           "--steps", str(steps), "--warmup", str(warmup)] + (["--smoke"] if smoke else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("OFFLOAD_MODE ")]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise RuntimeError(f"offload benchmark worker ({config}, seq {seq}, offload {mode}) failed:\n{tail}")
    return json.loads(lines[-1][len("OFFLOAD_MODE "):])


def measure(config: str, seq: int, steps: int, warmup: int, smoke: bool, layers: int, hidden: int,
            elem: int, reps: int = 2) -> dict:
    runs = {mode: [] for mode in MODES}
    for _ in range(1 if smoke else reps):
        for mode in MODES:
            runs[mode].append(spawn_mode(config, seq, mode, steps, warmup, smoke))
    off, on, lazy = runs["off"], runs["on"], runs["on-lazy"]
    one_input = seq * hidden * elem
    movable = (layers - 2) * one_input
    stats = on[-1]["offload_stats"] or {}
    moved = stats.get("offloaded_bytes", 0)
    r = {
        "seq": seq, "one_input_bytes": one_input, "movable_bytes": movable, "moved_bytes": moved,
        "moved_fraction": moved / movable if movable else 0.0,
        "step_s_off": statistics.median(x["step_s"] for x in off),
        "step_s_on": statistics.median(x["step_s"] for x in on),
        "first_step_s_off": min(x["first_step_s"] for x in off),
        "first_step_s_on": min(x["first_step_s"] for x in on),  # buffers pinned ahead
        "first_step_s_on_lazy": min(x["first_step_s"] for x in lazy),  # pinned inside the packs
        "first_step_pin_ms_on": _first_step(on, "pin_ms"), "first_step_pin_ms_on_lazy": _first_step(lazy, "pin_ms"),
        "first_step_prepinned_on": _first_step(on, "prepinned"),
        "offload_stats": stats,
    }
    for key in ("active_peak", "allocated_peak", "reserved_peak", "num_alloc_retries"):
        r[f"{key}_off"] = max(x[key] for x in off)
        r[f"{key}_on"] = max(x[key] for x in on)
    expected_drop = max(0, moved - offload.DEFAULT_PREFETCH_DEPTH * one_input)
    r["expected_drop_bytes"] = expected_drop
    r["active_drop_bytes"] = r["active_peak_off"] - r["active_peak_on"]
    r["removed_fraction"] = r["active_drop_bytes"] / expected_drop if expected_drop else 0.0
    r["allocated_drop_bytes"] = r["allocated_peak_off"] - r["allocated_peak_on"]
    r["time_ratio"] = r["step_s_on"] / r["step_s_off"]
    r["misses"] = [] if smoke else [m for m, bad in (
        (f"moved {r['moved_fraction']:.3f} < {TARGET_MOVED} of movable", r["moved_fraction"] < TARGET_MOVED),
        (f"active drop {r['removed_fraction']:.3f} < {TARGET_REMOVED} of expected",
         r["removed_fraction"] < TARGET_REMOVED),
        (f"time {r['time_ratio']:.3f}x > {TARGET_TIME}x", r["time_ratio"] > TARGET_TIME)) if bad]
    return r


def _first_step(runs: list[dict], key: str):
    """Step 1's figure from offload's own accounting (the smallest over the processes), None where absent."""
    values = [x["first_step_stats"][key] for x in runs if x.get("first_step_stats")]
    return min(values) if values else None


def run(quick: bool = False, *, seqs: list[int] | None = None, steps: int = 5, warmup: int = 2,
        smoke: bool = False, config: str = "qwen2-0.5b", reps: int = 2) -> dict | None:
    """None (with a message) without a CUDA device, unless ``smoke`` (tiny model on CPU, checks the code)."""
    model_type, cfg, default_seqs, quick_seqs = CONFIGS[config]
    if smoke:
        cfg, dtype, seqs, steps, warmup = TINY, torch.float32, [64], 1, 1
    elif not torch.cuda.is_available():
        print("offload: needs a CUDA GPU (it moves GPU memory to pinned host memory); skipped")
        return None
    else:
        dtype = torch.bfloat16
        seqs = seqs or (quick_seqs if quick else default_seqs)
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for seq in seqs:
        rows.append(measure(config, seq, steps, warmup, smoke, layers, hidden, elem, reps))
        if not smoke:
            print_table({"rows": rows[-1:]})
    return {
        "benchmark": NAME,
        "device": torch.cuda.get_device_name() if not smoke else "cpu (smoke)",
        "torch": torch.__version__,
        "model": {"config": "tiny" if smoke else config, "layers": layers, "hidden": hidden,
                  "dtype": str(dtype), "lora_r": 16},
        "targets": {"moved_fraction_min": TARGET_MOVED, "removed_fraction_min": TARGET_REMOVED,
                    "time_ratio_max": TARGET_TIME,
                    "arithmetic": "movable = (L-2) x S x H x bytes; expected active drop = moved - "
                                  "prefetch_depth x S x H x bytes"},
        "rows": rows,
    }


def print_table(report: dict) -> None:
    print(f"{'seq':>6} {'active off GiB':>14} {'active on GiB':>13} {'moved/movable':>13} {'drop/expected':>13} "
          f"{'alloc drop GiB':>14} {'step off s':>10} {'step on s':>10} {'time ratio':>10} {'stall ms':>8} "
          f"{'1st on s':>8} {'1st lazy s':>10}")
    for r in report["rows"]:
        flag = ("  <- " + "; ".join(r["misses"])) if r["misses"] else ""
        print(f"{r['seq']:>6} {r['active_peak_off'] / 2**30:>14.3f} {r['active_peak_on'] / 2**30:>13.3f} "
              f"{r['moved_fraction']:>13.3f} {r['removed_fraction']:>13.3f} {r['allocated_drop_bytes'] / 2**30:>14.3f} "
              f"{r['step_s_off']:>10.3f} {r['step_s_on']:>10.3f} {r['time_ratio']:>10.3f} "
              f"{(r['offload_stats'] or {}).get('stall_ms', 0.0):>8.2f} {r['first_step_s_on']:>8.3f} "
              f"{r['first_step_s_on_lazy']:>10.3f}{flag}", flush=True)


def plot(report: dict, path: str) -> str:
    from benchmarks._common import plot_pair

    rows = report["rows"]
    x = [r["seq"] for r in rows]
    plot_pair(path, x, {"offload off": [r["active_peak_off"] / 2**30 for r in rows],
                        "offload on": [r["active_peak_on"] / 2**30 for r in rows]},
              [r["time_ratio"] for r in rows], xlabel="sequence length", ylabel="active peak GiB",
              ratio_label="step time on / off", title=f"Offload of checkpoint inputs ({report['device']})",
              logx=True, target=TARGET_TIME)
    return path


def summarize(report: dict) -> list[str]:
    return [f"| offload {report['model']['config']}, seq {r['seq']} ({report['device']}) | "
            f"{r['moved_fraction']:.0%} of movable moved, {r['removed_fraction']:.0%} of the expected active-peak drop, "
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
    p.add_argument("--reps", type=int, default=2, help="processes per mode (off, on, off, on, ...)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.worker:
        result = one_mode(args.config, args.seq[0], args.worker, args.steps, args.warmup, smoke=args.smoke)
        print("OFFLOAD_MODE " + json.dumps(result), flush=True)
        return 0
    report = run(args.quick, seqs=args.seq, steps=args.steps, warmup=args.warmup, smoke=args.smoke,
                 config=args.config, reps=args.reps)
    if report is None:
        return 0
    from benchmarks._common import finish

    finish(sys.modules[__name__], report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
