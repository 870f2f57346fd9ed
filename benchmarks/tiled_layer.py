"""Tiled MLP in context: a checkpointed Llama decoder layer and a full training step, tiled vs untiled, 2-rank DDP
on CPU, with the MLP alone at the same shape beside them.

    python benchmarks/tiled_layer.py                   # H=128, I=512, 2 heads, 2 layers, 8K..32K tokens, 3 rounds
    python benchmarks/tiled_layer.py --tokens 8192 --rounds 5
    python benchmarks/tiled_layer.py --smoke           # small sizes: checks the script only
    python benchmarks/tiled_layer.py --device cuda --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 \
        --tokens 8192 16384 32768                      # Llama-8B-shaped, bf16, both ranks on the one GPU (gloo)

It starts 2 gloo ranks itself (torch.distributed.run); each rank has 1 torch thread. A Llama-shaped model (SDPA
attention, LoRA r=8 on every projection, non-reentrant checkpointing as the library runs it under DDP) is timed
three ways for each token count:
  layer  one checkpointed decoder layer (DDP around it): forward + backward from a random upstream gradient;
  step   the causal LM with every layer checkpointed: forward, loss, backward, AdamW step;
  mlp    the layer's MLP alone (as benchmarks/tiled_mlp.py): its peak memory, where the tiling acts.
Tiled and untiled (the same modules under ``tiled_mlp.untiled()``) alternate within each round, the order
flipping every round, so both see the same load on a machine shared with other work; times are medians over
the rounds, wall time (the targets) and each rank's CPU time beside it (less disturbed by other work). Memory:
the peak of tensor bytes allocated during one run of each (torch.profiler's allocation events), beyond what was
allocated before it. The automatic shard rule: ceil(tokens / hidden) shards, so every length here tiles.
Targets: time <= 1.03x for the layer and the step where the call tiles; MLP peak memory >= 8x lower at 32K.
Writes benchmarks/results/tiled_layer.json.

What the layer and step times show: since the checkpoint's recompute ends before the tiled forward
(NOTE [Recompute ends before the tiled forward] in ddp_patches/tiled_mlp/function.py), a tiled layer runs the MLP as
often as an untiled one, so what is left of the ratio is the per-shard overhead.
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

NAME = "tiled_layer"
TOKENS = [8192, 16384, 32768]
QUICK_TOKENS = [8192, 16384]
TIME_TARGET = 1.03
MEMORY_TARGETS = {32768: 8.0}  # MLP peak, untiled / tiled
KINDS = ("layer", "step", "mlp")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# -- on every rank -------------------------------------------------------------------------------------------------
def _config(args):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", vocab_size=args.vocab, hidden_size=args.hidden,
                                intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or args.heads,
                                max_position_embeddings=max(args.tokens), tie_word_embeddings=False)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))


def _build_layer(config):
    """One decoder layer behind a non-reentrant checkpoint, its rotary embedding computed outside it."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    class CheckpointedLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = LlamaDecoderLayer(config, layer_idx=0)
            self.rotary = LlamaRotaryEmbedding(config)

        def forward(self, h):
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            rope = self.rotary(h, positions)
            return checkpoint(self.layer, h, position_embeddings=rope, position_ids=positions, attention_mask=None,
                              use_reentrant=False)

    config._attn_implementation = "sdpa"
    return CheckpointedLayer()


def _build_lm(config):
    from transformers import AutoModelForCausalLM

    from ddp_patches.verify.hf_models import enable_checkpointing

    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    enable_checkpointing(model, {"use_reentrant": False})
    return model


def _build_mlp(config):
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(config)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_patches

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=60))
    torch.set_num_threads(args.threads)
    ddp_patches.apply(tiled_mlp=True)
    config = _config(args)
    models = {}
    device, dtype = _device_dtype(args)
    for kind, build in (("layer", _build_layer), ("step", _build_lm), ("mlp", _build_mlp)):
        torch.manual_seed(0)
        with torch.device(device):
            models[kind] = DDP(_lora(build(config).to(dtype)))
    rows = [_measure(models, args, tokens) for tokens in args.tokens]
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    del models
    leave_group()


def _device_dtype(args):
    import torch

    if args.device != "cuda":
        return "cpu", torch.float32
    if not torch.cuda.is_available():
        raise SystemExit("tiled_layer --device cuda needs a CUDA GPU (torch.cuda.is_available() is False here)")
    return "cuda:0", torch.bfloat16  # both ranks share the one GPU; gloo all-reduces through host copies


def _steps(models, args, tokens: int) -> dict:
    """One zero-argument callable per kind: a forward + backward (+ optimizer step for ``step``) on this rank's
    data."""
    import torch
    import torch.distributed as dist

    device, dtype = _device_dtype(args)
    g = torch.Generator().manual_seed(dist.get_rank())
    h = torch.randn(1, tokens, args.hidden, generator=g).to(device, dtype)
    grad = torch.randn(1, tokens, args.hidden, generator=g).to(device, dtype)
    ids = torch.randint(0, args.vocab, (1, tokens), generator=g).to(device)
    opt = torch.optim.AdamW([p for p in models["step"].parameters() if p.requires_grad], lr=1e-5)

    def layer():
        models["layer"](h.requires_grad_()).backward(grad)  # a layer input requires grad (earlier LoRA layers)
        models["layer"].zero_grad(set_to_none=True)
        h.grad = None

    def step():
        models["step"](input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def mlp():
        models["mlp"](h.detach()).backward(grad)
        models["mlp"].zero_grad(set_to_none=True)

    return {"layer": layer, "step": step, "mlp": mlp}


def _measure(models, args, tokens: int) -> list:
    """Warm-up, ``rounds`` interleaved timed runs of layer and step, one profiled run of each kind and variant;
    the rows of all ranks."""
    import torch.distributed as dist

    from ddp_patches import tiled_mlp

    import torch

    steps = _steps(models, args, tokens)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak = cuda_peak_bytes if cuda else peak_bytes

    def timed(fn, tiled: bool) -> tuple[float, float]:
        """Wall seconds, and this process's CPU seconds (all its threads): what preemption by other work on a
        shared machine does not inflate."""
        with _variant(tiled):
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            return time.perf_counter() - wall, time.process_time() - cpu

    for kind in ("layer", "step"):  # warm-up: allocator, first-call probes, lazy inits
        for tiled in (True, False):
            timed(steps[kind], tiled)
    times = {(kind, tiled): [] for kind in ("layer", "step") for tiled in (False, True)}
    for r in range(args.rounds):
        for kind in ("layer", "step"):
            for tiled in ((False, True) if r % 2 == 0 else (True, False)):
                times[kind, tiled].append(timed(steps[kind], tiled))
    peaks = {}
    for kind in KINDS:
        for tiled in (False, True):
            with _variant(tiled):
                peaks[kind, tiled] = peak(steps[kind])
    before = tiled_mlp.counts()
    timed(steps["layer"], True)
    after = tiled_mlp.counts()
    calls = after["tiled_calls"] - before["tiled_calls"]
    row = {"tokens": tokens, "tiles": calls > 0,
           "shards": (after["shards"] - before["shards"]) // calls if calls else 1}
    for (kind, tiled), values in times.items():
        variant = "tiled" if tiled else "untiled"
        row[f"{kind}_s_{variant}"] = statistics.median(wall for wall, _ in values)
        row[f"{kind}_cpu_s_{variant}"] = statistics.median(cpu for _, cpu in values)
        row[f"{kind}_s_{variant}_all"] = values
    for (kind, tiled), value in peaks.items():
        row[f"{kind}_peak_{'tiled' if tiled else 'untiled'}"] = value
    if args.profile:
        row["profile"] = _profile_layer(steps["layer"], timed)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, row)
    return gathered


def _profile_layer(layer, timed, top: int = 12) -> list[dict]:
    """Where the tiled layer's extra time goes: torch.profiler self time per op, tiled minus untiled, over one
    forward + backward of the checkpointed layer each; the ``top`` largest differences (ms, and calls)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = _cuda_available()  # then GPU time per kernel; else CPU self time per op

    def by_op(tiled: bool) -> dict:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            timed(layer, tiled)
        return {e.key: ((e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3, e.count)
                for e in prof.key_averages()}

    untiled, tiled = by_op(False), by_op(True)
    rows = [{"op": op, "extra_ms": tiled.get(op, (0, 0))[0] - untiled.get(op, (0, 0))[0],
             "calls_tiled": tiled.get(op, (0, 0))[1], "calls_untiled": untiled.get(op, (0, 0))[1]}
            for op in set(tiled) | set(untiled)]
    rows.sort(key=lambda r: -abs(r["extra_ms"]))
    total = {"op": "(all ops)", "extra_ms": sum(v[0] for v in tiled.values()) - sum(v[0] for v in untiled.values()),
             "calls_tiled": sum(v[1] for v in tiled.values()), "calls_untiled": sum(v[1] for v in untiled.values())}
    return [total] + rows[:top]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _variant(tiled: bool):
    import contextlib

    from ddp_patches import tiled_mlp

    return contextlib.nullcontext() if tiled else tiled_mlp.untiled()


# -- the launcher ----------------------------------------------------------------------------------------------------
def run(quick: bool = False, *, tokens: list[int] | None = None, hidden: int = 128, intermediate: int = 512,
        heads: int = 2, layers: int = 2, vocab: int = 256, rounds: int | None = None, threads: int = 1,
        kv_heads: int | None = None, device: str = "cpu", profile: bool = False) -> dict:
    """Tiled and untiled side by side on 2 gloo ranks; one row per token count (rank 0's numbers, all kept)."""
    tokens = tokens or (QUICK_TOKENS if quick else TOKENS)
    rounds = rounds or (1 if quick else 3)
    per_token = launch_ranks(os.path.abspath(__file__), 2, [
        "--hidden", str(hidden), "--intermediate", str(intermediate), "--heads", str(heads), "--layers", str(layers),
        "--vocab", str(vocab), "--rounds", str(rounds), "--threads", str(threads),
        "--kv-heads", str(kv_heads or heads), "--device", device, *(["--profile"] if profile else []),
        "--tokens", *map(str, tokens)], threads=threads, cuda=device == "cuda")
    rows = []
    for ranks in per_token:
        r0 = dict(ranks[0])
        r0["per_rank"] = ranks
        for kind in ("layer", "step"):
            r0[f"{kind}_time_ratio"] = r0[f"{kind}_s_tiled"] / r0[f"{kind}_s_untiled"]
            r0[f"{kind}_cpu_ratio"] = r0[f"{kind}_cpu_s_tiled"] / r0[f"{kind}_cpu_s_untiled"]
        for kind in KINDS:
            r0[f"{kind}_mem_ratio"] = r0[f"{kind}_peak_untiled"] / r0[f"{kind}_peak_tiled"]
        r0["mem_target"] = MEMORY_TARGETS.get(r0["tokens"])
        r0["misses"] = _misses(r0)
        rows.append(r0)
    return {
        "benchmark": NAME,
        "setup": {"hidden": hidden, "intermediate": intermediate, "heads": heads, "kv_heads": kv_heads or heads,
                  "layers": layers, "vocab": vocab, "lora_r": 8, "ranks": 2, "device": device,
                  "dtype": "bfloat16" if device == "cuda" else "float32", "attention": "sdpa",
                  "checkpointing": "non-reentrant", "backend": "gloo", "threads_per_rank": threads,
                  "rounds": rounds, "shard_rule": "bytes: min(ceil(5I/H), T//H)"},
        "targets": {"time_ratio_max": TIME_TARGET, "mlp_memory": MEMORY_TARGETS},
        "rows": rows,
    }


def _misses(row: dict) -> list[str]:
    misses = []
    for kind in ("layer", "step"):
        if row["tiles"] and row[f"{kind}_time_ratio"] > TIME_TARGET:
            misses.append(f"{kind} time {row[f'{kind}_time_ratio']:.3f}x > {TIME_TARGET}x")
    if row["mem_target"] and row["mlp_mem_ratio"] < row["mem_target"]:
        misses.append(f"MLP memory {row['mlp_mem_ratio']:.2f}x < {row['mem_target']:g}x")
    return misses


def print_profile(report: dict) -> None:
    for r in report["rows"]:
        if r.get("profile"):
            print(f"{r['tokens']} tokens, {r['shards']} shards: self time per op, tiled - untiled (one layer run)")
            for p in r["profile"]:
                print(f"  {p['op']:<40} {p['extra_ms']:>+9.2f} ms   calls {p['calls_untiled']:>5} -> "
                      f"{p['calls_tiled']:>5}")


def print_table(report: dict) -> None:
    """Untiled -> tiled medians and their ratios, side by side: wall time (CPU time of the rank in brackets) for
    the layer and the step, then untiled / tiled peak memory of the MLP, the layer and the step."""
    print(f"{'tokens':>6} {'shards':>6} | {'layer s':>15} {'ratio (cpu)':>17} | {'step s':>15} "
          f"{'ratio (cpu)':>17} | {'less memory: MLP':>16} {'layer':>6} {'step':>6}")
    for r in report["rows"]:
        flag = ("  <- " + "; ".join(r["misses"])) if r["misses"] else ""
        cells = [f"{r[f'{k}_s_untiled']:>6.2f} -> {r[f'{k}_s_tiled']:>6.2f} {r[f'{k}_time_ratio']:>6.3f}x "
                 f"({r[f'{k}_cpu_ratio']:.3f}x)" for k in ("layer", "step")]
        print(f"{r['tokens']:>6} {r['shards']:>6} | {cells[0]} | {cells[1]} | {r['mlp_mem_ratio']:>15.2f}x "
              f"{r['layer_mem_ratio']:>5.2f}x {r['step_mem_ratio']:>5.2f}x{flag}", flush=True)


def plot(report: dict, path: str) -> str:
    rows = report["rows"]
    x = [r["tokens"] for r in rows]
    setup = report["setup"]
    shape = f"H={setup['hidden']}, I={setup['intermediate']}, {setup['layers']} layers, 2 ranks"
    secs = {f"{kind} {variant}": [r[f"{kind}_s_{variant}"] for r in rows]
            for kind in ("layer", "step") for variant in ("untiled", "tiled")}
    plot_pair(path, x, secs, [r["step_time_ratio"] for r in rows], xlabel="tokens", ylabel="seconds (median)",
              ratio_label="tiled / untiled step time", title=f"Tiled MLP in a layer and a step: time ({shape})",
              logx=True, target=TIME_TARGET)
    base, ext = os.path.splitext(path)
    mib = {f"{kind} {variant}": [r[f"{kind}_peak_{variant}"] / 2**20 for r in rows]
           for kind in KINDS for variant in ("untiled", "tiled")}
    plot_pair(base + "_memory" + ext, x, mib, [r["mlp_mem_ratio"] for r in rows], xlabel="tokens",
              ylabel="per-rank peak MiB", ratio_label="untiled / tiled MLP memory",
              title=f"Tiled MLP in a layer and a step: memory ({shape})", logx=True)
    return path


def summarize(report: dict) -> list[str]:
    setup = report["setup"]
    out = []
    for r in report["rows"]:
        target = f"<= {TIME_TARGET}x time" + (f", >= {r['mem_target']:g}x MLP memory" if r["mem_target"] else "")
        where = "CUDA, bf16" if setup.get("device") == "cuda" else "CPU"
        out.append(f"| tiled MLP in a checkpointed layer / training step, {r['tokens']} tokens ({where}, 2 ranks, "
                   f"H={setup['hidden']}, {setup['layers']} layers, {r['shards']} shards) | layer {r['layer_time_ratio']:.3f}x, step "
                   f"{r['step_time_ratio']:.3f}x time (CPU time {r['layer_cpu_ratio']:.3f}x, "
                   f"{r['step_cpu_ratio']:.3f}x); {r['mlp_mem_ratio']:.2f}x less MLP memory (layer "
                   f"{r['layer_mem_ratio']:.2f}x, step {r['step_mem_ratio']:.2f}x) | {target} | "
                   f"{'missed: ' + '; '.join(r['misses']) if r['misses'] else 'met'} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: bf16, both ranks on cuda:0 over gloo (needs a GPU)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds (default 3; --quick 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--quick", action="store_true", help="8K and 16K tokens, 1 round")
    p.add_argument("--profile", action="store_true",
                   help="also profile one layer run each way: self time per op, tiled minus untiled")
    p.add_argument("--smoke", action="store_true", help="H=32, I=128, 512/1024 tokens: checks the script only")
    p.add_argument("--out-dir", default=None, help="where <name>.json and the plots go (default benchmarks/results)")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.intermediate, args.tokens, args.rounds = 32, 128, [512, 1024], 1
    if args.worker_out:
        worker(args)
        return 0
    report = run(args.quick, tokens=args.tokens, hidden=args.hidden, intermediate=args.intermediate,
                 heads=args.heads, layers=args.layers, vocab=args.vocab, rounds=args.rounds, threads=args.threads,
                 kv_heads=args.kv_heads, device=args.device, profile=args.profile)
    finish(sys.modules[__name__], report, args.out_dir)
    print_profile(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
