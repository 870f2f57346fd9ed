"""Cost of the guard (ddp_patches/guard/) per optimizer step, at the default replica-check interval, on 2 CPU ranks.

    python benchmarks/guard.py            # Llama-shaped, hidden 256, 4 layers, batch 4 x 256: LoRA r=8, and full
    python benchmarks/guard.py --quick

On each rank two DDP models of each kind are built under apply(): one with the guard (its forward pre-hook, a
post-accumulate-grad hook per trainable parameter, the optimizer step hooks), one without (built while the guard
tracks nothing, every other patch the same); they are stepped in interleaved rounds. Then the replica check itself
(fingerprint + rendezvous-store exchange) is timed on its own. The figure is

    (hooks per step + check time / replica_check_every) / median step without the guard

target <= 0.5%. The hooks (one post-accumulate-grad call per trainable tensor, the pre-step walk over the
optimizer's parameters) and the check are timed on their own: on a shared 2-core machine the interleaved A/B
step difference swings by several percent either way, and is printed only as a sanity check. Writes
benchmarks/results/guard.json (no plot: two numbers per model).
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

NAME = "guard"
TARGET = 0.005
KINDS = ("lora", "full")


def run(quick: bool = False, *, seq: int = 256, rounds: int | None = None) -> dict:
    from benchmarks._common import launch_ranks

    rounds = rounds or (6 if quick else 20)
    ranks = launch_ranks(os.path.abspath(__file__), 2, ["--seq", str(seq), "--rounds", str(rounds)])
    from ddp_patches.guard.replica_check import DEFAULT_REPLICA_CHECK_EVERY as every

    rows = {}
    for kind in KINDS:
        # Per round the slower rank sets the pace: compare the ranks' per-round maxima.
        per_round = {cfg: [max(r[kind]["all_s"][cfg][i] for r in ranks) for i in range(rounds)]
                     for cfg in ("without", "with")}
        med = {cfg: statistics.median(v) for cfg, v in per_round.items()}
        check = max(r[kind]["check_s"] for r in ranks)
        hooks = max(r[kind]["hooks_s"] for r in ranks)
        rows[kind] = {"trainable_params": ranks[0][kind]["trainable"], "trainable_tensors": ranks[0][kind]["tensors"],
                      "median_step_s": med, "hooks_s_per_step": hooks, "check_s": check,
                      "ab_difference_ratio": (med["with"] - med["without"]) / med["without"],
                      "cost_ratio": (hooks + check / every) / med["without"],
                      "check_only_ratio": check / every / med["without"]}
    misses = [f"{k}: {v['cost_ratio']:.2%} > {TARGET:.1%}" for k, v in rows.items() if v["cost_ratio"] > TARGET]
    return {"benchmark": NAME,
            "setup": {"model": "llama hidden 256, 4 layers, checkpointing", "batch": 4, "seq": seq, "ranks": 2,
                      "backend": "gloo", "threads_per_rank": 1, "rounds": rounds, "replica_check_every": every},
            "targets": {"cost_ratio_max": TARGET}, "rows": rows, "misses": misses}


def print_table(report: dict) -> None:
    every = report["setup"]["replica_check_every"]
    for kind, r in report["rows"].items():
        print(f"{kind:5} ({r['trainable_tensors']} trainable tensors, {r['trainable_params']:,} values): step "
              f"{r['median_step_s']['without'] * 1000:.1f} ms without the guard, "
              f"{r['median_step_s']['with'] * 1000:.1f}"
              f" ms with (A/B difference {r['ab_difference_ratio']:+.1%}, within this machine's noise); hooks "
              f"{r['hooks_s_per_step'] * 1e6:.0f} us/step timed alone; one replica check {r['check_s'] * 1000:.2f} ms")
        print(f"      cost at replica_check_every={every}: {r['cost_ratio']:.3%} of a step (target <= "
              f"{TARGET:.1%}; the check alone {r['check_only_ratio']:.4%})")
    if report["misses"]:
        print("MISSED: " + "; ".join(report["misses"]))


def plot(report: dict, path: str) -> None:
    return None


def summarize(report: dict) -> list[str]:
    status = "missed" if report["misses"] else "met"
    every = report["setup"]["replica_check_every"]
    return [f"| guard per step (hooks + replica check / {every}), {kind} (CPU, 2 ranks) | "
            f"{r['cost_ratio']:.3%} | <= {TARGET:.1%} | {status} |" for kind, r in report["rows"].items()]


# -- worker ----------------------------------------------------------------------------------------------------
def _build(kind: str):
    from benchmarks._llm_steps import build

    model = build({"use_reentrant": True}, 256, 4)
    if kind == "full":
        model = model.merge_and_unload()
        model.requires_grad_(True)
        model.train()
    return model


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_patches
    from ddp_patches.guard import replica_check, steps as guard_steps, unsynced as guard

    from benchmarks._common import leave_group

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    ddp_patches.apply()
    out = {}
    for kind in KINDS:
        guard._settings.active = False  # the model "without": built while the guard tracks nothing
        models = {"without": DDP(_build(kind))}
        guard._settings.active = True
        models["with"] = DDP(_build(kind))
        optims = {k: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for k, m in models.items()}
        ids = torch.randint(0, 512, (4, args.seq), generator=torch.Generator().manual_seed(1000 + rank))
        times = {k: [] for k in models}
        for i in range(2 + args.rounds):
            for name in (("without", "with") if i % 2 == 0 else ("with", "without")):
                start = time.perf_counter()
                models[name](input_ids=ids, labels=ids).loss.backward()
                optims[name].step()
                optims[name].zero_grad(set_to_none=True)
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
        params = [p for p in models["with"].parameters() if p.requires_grad]
        tracked = guard._owner[id(params[0])]
        hook, overhead = guard._Written(tracked), []
        for i in range(200):  # what the guard adds to a step without a check, timed alone (the A/B is noise-bound)
            tracked.steps = 3  # the pre-hook counts this one as step 4: no check due
            tracked.synced_forwards += 1  # what the synced forward of a training step records
            start = time.perf_counter()
            for p in params:
                hook(p)  # a backward calls it once per trainable tensor
            guard_steps._pre_step(optims["with"], (), {})
            overhead.append(time.perf_counter() - start)
        checks = []
        for i in range(10):
            tracked.steps = 1_000_000 + i  # fresh keys
            dist.barrier()
            start = time.perf_counter()
            assert replica_check.check_replicas(tracked) is not False  # None: the peer's record not there yet
            checks.append(time.perf_counter() - start)
        out[kind] = {"all_s": times, "check_s": statistics.median(checks), "hooks_s": statistics.median(overhead),
                     "tensors": len(params),
                     "trainable": sum(p.numel() for p in params)}
        models.clear()
        optims.clear()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(gathered, f)
    ddp_patches.revert()
    leave_group()


def gpu_check(args) -> dict:
    """One process on one CUDA device: a Qwen2-0.5B-shaped model (24 layers, hidden 896), bf16, every parameter
    trainable, checkpointing, AdamW, batch 1 x seq: the median step, and the replica check's fingerprint on the GPU
    (the store exchange adds a small constant, measured on CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddp_patches.guard import replica_check

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                  num_hidden_layers=args.layers, num_attention_heads=14, num_key_value_heads=2,
                                  max_position_embeddings=32768, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(args.device, torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, 151936, (1, args.seq), device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    steps, checks = [], []
    for i in range(3 + args.rounds):
        sync()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= 3:
            steps.append(time.perf_counter() - start)
    for _ in range(10):
        sync()
        start = time.perf_counter()
        replica_check.fingerprint(params)  # ends with .cpu(): a synchronisation, included
        checks.append(time.perf_counter() - start)
    step, check = statistics.median(steps), statistics.median(checks)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "layers": args.layers,
              "torch": torch.__version__, "seq": args.seq,
              "trainable_tensors": len(params), "trainable_params": sum(p.numel() for p in params),
              "median_step_s": step, "fingerprint_s": check,
              "check_ratio_at_default": check / replica_check.DEFAULT_REPLICA_CHECK_EVERY / step}
    print(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int)
    p.add_argument("--worker-out")
    p.add_argument("--out-dir")
    p.add_argument("--gpu", action="store_true", help="the fingerprint against a bf16 0.5B step on one CUDA device")
    p.add_argument("--device", default="cuda", help="with --gpu: where to run it (cpu: a smoke run)")
    p.add_argument("--layers", type=int, default=24, help="with --gpu: decoder layers (24: Qwen2-0.5B)")
    args = p.parse_args(argv)
    if args.gpu:
        args.seq = args.seq if args.seq != 256 else 2048
        args.rounds = args.rounds or 10
        gpu_check(args)
        return 0
    if args.worker_out:
        worker(args)
        return 0
    from benchmarks._common import finish

    finish(sys.modules[__name__], run(args.quick, seq=args.seq, rounds=args.rounds), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
