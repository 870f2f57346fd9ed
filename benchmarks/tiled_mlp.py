"""Per-rank peak memory and time of one MLP forward+backward, tiled vs untiled, under 2-rank DDP on CPU.

    python benchmarks/tiled_mlp.py                       # H=1024, I=4096, fp32, LoRA r=8, 4K/8K/16K/32K tokens
    python benchmarks/tiled_mlp.py --tokens 4096 8192 --repeats 3
    python benchmarks/tiled_mlp.py --smoke               # small sizes: checks the script only

It starts 2 gloo ranks itself (torch.distributed.run). Each rank holds one Llama MLP with LoRA (r=8) in DDP,
and for each token count runs the tiled and the untiled forward+backward alternately (untiled is the same module
under ``tiled_mlp.untiled()``), so both see the same process, weights and data. Memory is the peak of tensor
bytes allocated during one forward+backward (torch.profiler's allocation events, beyond the input and the
upstream gradient already held), time the median over repeats of unprofiled runs. Shard count: the automatic
rule, ceil(tokens / hidden). Targets from the tiled-MLP issue: memory >= 4x lower at 8K and >= 8x at 32K, time
<= 1.10x. Writes benchmarks/results/tiled_mlp.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TARGETS = {8192: 4.0, 32768: 8.0}
TIME_TARGET = 1.10


def peak_bytes(fn) -> int:
    """Peak of live tensor bytes allocated while ``fn`` runs (CPU allocation events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from types import SimpleNamespace

    import ddp_patches
    from ddp_patches import tiled_mlp

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank = dist.get_rank()
    torch.set_num_threads(args.threads)
    ddp_patches.apply(tiled_mlp=True)
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=args.hidden, intermediate_size=args.intermediate, hidden_act="silu",
                             mlp_bias=False)
    mlp = get_peft_model(LlamaMLP(config), LoraConfig(r=8, lora_alpha=16,
                                                       target_modules=["gate_proj", "up_proj", "down_proj"]))
    model = DDP(mlp)
    rows = []
    for tokens in args.tokens:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(1, tokens, args.hidden, generator=g)
        grad = torch.randn(1, tokens, args.hidden, generator=g)

        def step():
            model(x).backward(grad)
            model.zero_grad(set_to_none=True)

        def run(tiled: bool, measure_memory: bool):
            ctx = tiled_mlp.untiled() if not tiled else torch.enable_grad()
            with ctx:
                if measure_memory:
                    return peak_bytes(step)
                start = time.perf_counter()
                step()
                return time.perf_counter() - start

        run(True, False)  # warm-up
        run(False, False)
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for tiled in (False, True):
                times[tiled].append(run(tiled, False))
        peaks = {tiled: run(tiled, True) for tiled in (False, True)}
        shards = len(tiled_mlp.shard_sizes(tokens, args.hidden, None))
        row = {
            "tokens": tokens,
            "shards": shards,
            "peak_bytes_untiled": peaks[False],
            "peak_bytes_tiled": peaks[True],
            "step_s_untiled": statistics.median(times[False]),
            "step_s_tiled": statistics.median(times[True]),
        }
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        if rank == 0:
            rows.append(gathered)
            r = gathered[0]
            mem = r["peak_bytes_untiled"] / r["peak_bytes_tiled"]
            tr = r["step_s_tiled"] / r["step_s_untiled"]
            target = TARGETS.get(tokens)
            flag = ""
            if target and mem < target:
                flag += f"  <- memory target {target:.0f}x missed"
            if tr > TIME_TARGET:
                flag += f"  <- time target {TIME_TARGET}x missed"
            print(f"{tokens:>6} {shards:>6} {r['peak_bytes_untiled'] / 2**20:>12.1f} {r['peak_bytes_tiled'] / 2**20:>10.1f} "
                  f"{mem:>9.2f}x {r['step_s_untiled']:>10.3f} {r['step_s_tiled']:>9.3f} {tr:>9.2f}x{flag}", flush=True)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--smoke", action="store_true", help="H=64, I=256, 512/1024 tokens: checks the script only")
    p.add_argument("--out", default=os.path.join(RESULTS, "tiled_mlp.json"))
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.intermediate, args.tokens, args.repeats = 64, 256, [512, 1024], 1
    if args.worker_out:
        worker(args)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), "--worker-out", out, "--hidden", str(args.hidden),
               "--intermediate", str(args.intermediate), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--tokens", *map(str, args.tokens)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), CUDA_VISIBLE_DEVICES="")
        print(f"tiled MLP, 2 ranks (gloo, CPU), H={args.hidden}, I={args.intermediate}, fp32, LoRA r=8; "
              "per-rank numbers of rank 0")
        print(f"{'tokens':>6} {'shards':>6} {'untiled MiB':>12} {'tiled MiB':>10} {'mem ratio':>10} "
              f"{'untiled s':>10} {'tiled s':>9} {'time ratio':>10}", flush=True)
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0:
            print(f"benchmark ranks failed (exit {done.returncode})")
            return done.returncode
        with open(out) as f:
            per_token = json.load(f)
    rows = []
    for ranks in per_token:
        r0 = dict(ranks[0])
        r0["per_rank"] = ranks
        r0["mem_ratio"] = r0["peak_bytes_untiled"] / r0["peak_bytes_tiled"]
        r0["time_ratio"] = r0["step_s_tiled"] / r0["step_s_untiled"]
        r0["mem_target"] = TARGETS.get(r0["tokens"])
        rows.append(r0)
    report = {
        "benchmark": "tiled_mlp",
        "date": time.strftime("%Y-%m-%d"),
        "setup": {"hidden": args.hidden, "intermediate": args.intermediate, "dtype": "float32", "lora_r": 8,
                  "ranks": 2, "backend": "gloo", "threads_per_rank": args.threads, "shard_rule": "ceil(T/H)"},
        "targets": {"memory": TARGETS, "time_ratio_max": TIME_TARGET},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
