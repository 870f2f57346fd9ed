"""Per-rank peak memory and time of one MLP forward+backward, tiled vs untiled, under 2-rank DDP on CPU.

    python benchmarks/tiled_mlp.py                       # H=1024, I=4096, fp32, LoRA r=8, 1K..32K tokens
    python benchmarks/tiled_mlp.py --tokens 4096 8192 --repeats 3
    python benchmarks/tiled_mlp.py --smoke               # small sizes: checks the script only
    python benchmarks/tiled_mlp.py --device cuda --hidden 4096 --intermediate 14336 --tokens 8192 32768
                                                         # Llama-8B MLP, bf16, both ranks on the one GPU

It starts 2 gloo ranks itself (torch.distributed.run). Each rank holds one Llama MLP with LoRA (r=8) in DDP,
and for each token count runs the tiled and the untiled forward+backward alternately (untiled is the same module
under ``tiled_mlp.untiled()``), so both see the same process, weights and data. Memory is the peak of tensor
bytes allocated during one forward+backward (torch.profiler's allocation events, beyond the input and the
upstream gradient already held), time the median over repeats of unprofiled runs. Shard count: the automatic
rule by bytes, min(ceil(5 I / H), tokens // H) shards (NOTE [Tiling by bytes]), as counted during the run; where it
leaves a call untiled, the "tiled" column is the untiled forward the library then runs. This times a bare MLP
without checkpointing (1 forward + backward untiled, 2 forwards + backward tiled), which is not how the library is
used under DDP: benchmarks/tiled_layer.py times a checkpointed layer and a training step. Targets:
memory >= 4x lower at 8K and >= 8x at 32K, time <= 1.10x at every length. Writes
benchmarks/results/tiled_mlp.json.
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

from benchmarks._common import cuda_peak_bytes, finish, launch_ranks, leave_group, peak_bytes, plot_pair  # noqa: E402

NAME = "tiled_mlp"
TOKENS = [1024, 2048, 4096, 8192, 16384, 32768]
QUICK_TOKENS = [1024, 2048, 4096, 8192]
TARGETS = {8192: 4.0, 32768: 8.0}
TIME_TARGET = 1.10


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from types import SimpleNamespace

    import ddp_patches

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    torch.set_num_threads(args.threads)
    ddp_patches.apply(tiled_mlp=True)
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=args.hidden, intermediate_size=args.intermediate, hidden_act="silu",
                             mlp_bias=False)
    cuda = args.device == "cuda"
    mlp = LlamaMLP(config).to("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    model = DDP(get_peft_model(mlp, LoraConfig(r=8, lora_alpha=16,
                                               target_modules=["gate_proj", "up_proj", "down_proj"])))
    rows = _sweep(model, args)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    del model
    leave_group()


def _sweep(model, args) -> list:
    """For each token count: warm-up, interleaved timed runs, one profiled run per variant; rows of all ranks."""
    import torch
    import torch.distributed as dist

    from ddp_patches import tiled_mlp

    rank = dist.get_rank()
    rows = []
    for tokens in args.tokens:
        cuda = args.device == "cuda"
        place = dict(device="cuda", dtype=torch.bfloat16) if cuda else {}
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(1, tokens, args.hidden, generator=g).to(**place)
        grad = torch.randn(1, tokens, args.hidden, generator=g).to(**place)

        def step():
            model(x).backward(grad)
            model.zero_grad(set_to_none=True)

        def run(tiled: bool, measure_memory: bool):
            ctx = tiled_mlp.untiled() if not tiled else torch.enable_grad()
            with ctx:
                if measure_memory:
                    return cuda_peak_bytes(step) if cuda else peak_bytes(step)
                sync = torch.cuda.synchronize if cuda else (lambda: None)
                sync()
                start = time.perf_counter()
                step()
                sync()
                return time.perf_counter() - start

        run(True, False)  # warm-up
        run(False, False)
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for tiled in (False, True):
                times[tiled].append(run(tiled, False))
        peaks = {tiled: run(tiled, True) for tiled in (False, True)}
        before = tiled_mlp.counts()
        run(True, False)
        after = tiled_mlp.counts()
        calls = after["tiled_calls"] - before["tiled_calls"]
        row = {
            "tokens": tokens,
            "shards": (after["shards"] - before["shards"]) // calls if calls else 1,
            "tiles": calls > 0,
            "peak_bytes_untiled": peaks[False],
            "peak_bytes_tiled": peaks[True],
            "step_s_untiled": statistics.median(times[False]),
            "step_s_tiled": statistics.median(times[True]),
        }
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        rows.append(gathered)
    return rows


def run(quick: bool = False, *, tokens: list[int] | None = None, hidden: int = 1024, intermediate: int = 4096,
        repeats: int | None = None, threads: int = 1, device: str = "cpu") -> dict:
    """Both variants side by side on 2 gloo ranks; one row per token count (rank 0's numbers, all ranks kept)."""
    tokens = tokens or (QUICK_TOKENS if quick else TOKENS)
    repeats = repeats or (1 if quick else 3)
    per_token = launch_ranks(os.path.abspath(__file__), 2, [
        "--hidden", str(hidden), "--intermediate", str(intermediate), "--repeats", str(repeats),
        "--threads", str(threads), "--device", device, "--tokens", *map(str, tokens)], threads=threads,
        cuda=device == "cuda")
    rows = []
    for ranks in per_token:
        r0 = dict(ranks[0])
        r0["per_rank"] = ranks
        r0["mem_ratio"] = r0["peak_bytes_untiled"] / r0["peak_bytes_tiled"]
        r0["time_ratio"] = r0["step_s_tiled"] / r0["step_s_untiled"]
        r0["mem_target"] = TARGETS.get(r0["tokens"])
        r0["misses"] = _misses(r0)
        rows.append(r0)
    return {
        "benchmark": NAME,
        "setup": {"hidden": hidden, "intermediate": intermediate, "lora_r": 8, "ranks": 2, "device": device,
                  "dtype": "bfloat16" if device == "cuda" else "float32", "backend": "gloo", "threads_per_rank": threads, "repeats": repeats, "shard_rule": "bytes: min(ceil(5I/H), T//H)"},
        "targets": {"memory": TARGETS, "time_ratio_max": TIME_TARGET},
        "rows": rows,
    }


def _misses(row: dict) -> list[str]:
    misses = []
    if row["mem_target"] and row["mem_ratio"] < row["mem_target"]:
        misses.append(f"memory {row['mem_ratio']:.2f}x < {row['mem_target']:g}x")
    if row["time_ratio"] > TIME_TARGET:
        misses.append(f"time {row['time_ratio']:.2f}x > {TIME_TARGET}x")
    return misses


def print_table(report: dict) -> None:
    print(f"{'tokens':>6} {'shards':>6} {'tiles':>5} {'untiled MiB':>12} {'tiled MiB':>10} {'mem ratio':>10} "
          f"{'untiled s':>10} {'tiled s':>9} {'time ratio':>10}")
    for r in report["rows"]:
        flag = ("  <- " + "; ".join(r["misses"])) if r["misses"] else ""
        print(f"{r['tokens']:>6} {r['shards']:>6} {_tiles(r):>5} {r['peak_bytes_untiled'] / 2**20:>12.1f} "
              f"{r['peak_bytes_tiled'] / 2**20:>10.1f} {r['mem_ratio']:>9.2f}x {r['step_s_untiled']:>10.3f} "
              f"{r['step_s_tiled']:>9.3f} {r['time_ratio']:>9.2f}x{flag}", flush=True)


def _tiles(row: dict) -> str:
    return "yes" if row.get("tiles", row["shards"] > 1) else "no"


def plot(report: dict, path: str) -> str:
    rows = report["rows"]
    x = [r["tokens"] for r in rows]
    mib = {"untiled": [r["peak_bytes_untiled"] / 2**20 for r in rows],
           "tiled": [r["peak_bytes_tiled"] / 2**20 for r in rows]}
    base, ext = os.path.splitext(path)
    setup = report["setup"]
    shape = f"H={setup['hidden']}, I={setup['intermediate']}, LoRA r=8, 2 ranks"
    plot_pair(path, x, mib, [r["mem_ratio"] for r in rows], xlabel="tokens", ylabel="per-rank peak MiB",
              ratio_label="untiled / tiled memory", title=f"Tiled MLP: memory ({shape})", logx=True)
    secs = {"untiled": [r["step_s_untiled"] for r in rows], "tiled": [r["step_s_tiled"] for r in rows]}
    plot_pair(base + "_time" + ext, x, secs, [r["time_ratio"] for r in rows], xlabel="tokens",
              ylabel="forward+backward s", ratio_label="tiled / untiled time", title=f"Tiled MLP: time ({shape})",
              logx=True, target=TIME_TARGET)
    return path


def summarize(report: dict) -> list[str]:
    out = []
    for r in report["rows"]:
        target = f">= {r['mem_target']:g}x memory, <= {TIME_TARGET}x time" if r["mem_target"] else \
            f"<= {TIME_TARGET}x time"
        how = f"tiled in {r['shards']}" if _tiles(r) == "yes" else "runs untiled (auto rule)"
        where = "GPU" if report["setup"].get("device") == "cuda" else "CPU"
        out.append(f"| tiled MLP alone, no checkpoint (1 forward + backward vs 2 + backward), {r['tokens']} tokens, "
                   f"{how} ({where}, 2 ranks) | {r['mem_ratio']:.2f}x less memory, "
                   f"{r['time_ratio']:.2f}x time | {target} | "
                   f"{'missed: ' + '; '.join(r['misses']) if r['misses'] else 'met'} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--quick", action="store_true", help="1K..8K tokens, 1 repeat")
    p.add_argument("--smoke", action="store_true", help="H=64, I=256, 512/1024 tokens: checks the script only")
    p.add_argument("--out-dir", default=None, help="where <name>.json and the plots go (default benchmarks/results)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: both ranks on the visible GPU(s), bf16, active-byte peaks")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.intermediate, args.tokens, args.repeats = 64, 256, [512, 1024], 1
    if args.worker_out:
        worker(args)
        return 0
    report = run(args.quick, tokens=args.tokens, hidden=args.hidden, intermediate=args.intermediate,
                 repeats=args.repeats, threads=args.threads, device=args.device)
    finish(sys.modules[__name__], report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
