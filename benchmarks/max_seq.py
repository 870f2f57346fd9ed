"""The longest sequence one rank can train in one step under a fixed memory budget, patched vs unpatched.

    python benchmarks/max_seq.py                     # CPU, 2 gloo ranks, Llama-shaped (I/H = 4, V/H = 32), 192 MiB
    python benchmarks/max_seq.py --budget-mib 96 --layers 2
    python benchmarks/max_seq.py --smoke             # tiny budget: checks the script only
    python benchmarks/max_seq.py --device cuda --hidden 4096 --intermediate 14336 --vocab 131072 --layers 8 \\
        --budget-mib 40960                           # GPU: Llama-8B-shaped layers, bf16 (not yet run on a GPU)

Both sides run under 2-rank DDP, LoRA r=8 on every projection, through TRL's fused LM head
(``trl.trainer.utils.add_fused_lm_head``, what SFTTrainer uses), so the logits are not what limits the length:
  * unpatched: the best configuration that works without the library, non-reentrant checkpointing with
    ``find_unused_parameters=False``;
  * patched: ``apply(tiled_mlp=True, offload=True)`` with the same model (offload acts only on CUDA; on CPU the
    difference is the tiled MLP).
The search doubles the length from ``--first-seq`` until a step's peak passes the budget, then bisects to
``--resolution`` tokens. Memory per step: CPU, the peak of live tensor bytes from profiler allocation events
(benchmarks._common.peak_bytes), beyond the model and optimizer state; GPU, the ACTIVE-bytes peak
(``active_bytes.all.peak``) beyond what was active before the step. Both ranks probe the same lengths in lockstep
(the larger of their two peaks decides). The report also gives the per-token memory of each part at
``--probe-tokens`` tokens: checkpoint inputs (L x H x bytes, analytic), one layer's MLP and attention forward +
backward (measured), the fused head forward + backward (measured).

The anchor is ALST (Arctic Long Sequence Training, Snowflake): tiled MLP + tiled loss + checkpoint offload gave
about 15x longer sequences than the baseline for Llama-8B on one H100. This benchmark reaches for the same
levers but not sequence parallelism; the README says where we stand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._common import cuda_peak_bytes, finish, launch_ranks, leave_group, peak_bytes  # noqa: E402

NAME = "max_seq"


def build(args, device: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from ddp_patches.verify.hf_models import enable_checkpointing

    config = AutoConfig.for_model("llama", vocab_size=args.vocab, hidden_size=args.hidden,
                                  intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                  num_attention_heads=max(1, args.hidden // 64),
                                  num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=1 << 20,
                                  tie_word_embeddings=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.config.use_cache = False
    enable_checkpointing(model, {"use_reentrant": False})
    add_fused_lm_head(model)  # before PEFT, as TRL does
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    model.train()
    return model


def step_peak(model, seq: int, vocab: int, device: str) -> int:
    """Peak bytes of one forward + backward at ``seq`` tokens, beyond what was live before it."""
    import torch

    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), generator=g).to(device)

    def step():
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    if device != "cuda":
        return peak_bytes(step)
    try:
        return cuda_peak_bytes(step)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return 1 << 62


def search(model, args, device: str) -> dict:
    """Doubling, then bisection; both ranks probe the same lengths (the larger peak decides)."""
    import torch
    import torch.distributed as dist

    budget = args.budget_mib << 20
    probes = []

    def fits(seq: int) -> bool:
        peak = torch.tensor([step_peak(model, seq, args.vocab, device)], dtype=torch.int64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        probes.append({"seq": seq, "peak_bytes": int(peak.item())})
        return peak.item() <= budget

    lo, hi = 0, args.start
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > args.max_tokens:
            return {"max_seq": lo, "capped_at": args.max_tokens, "probes": probes}
    while hi - lo > args.resolution:
        mid = (lo + hi) // 2 // args.resolution * args.resolution or args.resolution
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"max_seq": lo, "probes": probes}


def parts_per_token(model, args, device: str) -> dict:
    """Per-token bytes of each part at ``--probe-tokens`` tokens (one layer's MLP and attention, the head)."""
    import torch

    T, elem = args.probe_tokens, 2 if device == "cuda" else 4
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = model.get_base_model()
    layer = base.model.layers[0]
    x = torch.randn(1, T, args.hidden, device=device, dtype=dtype, requires_grad=True)

    def run(fn):
        def go():
            fn().float().sum().backward()
            model.zero_grad(set_to_none=True)
        return peak_bytes(go) if device != "cuda" else cuda_peak_bytes(go)

    position_ids = torch.arange(T, device=device)[None]
    cos_sin = base.model.rotary_emb(x, position_ids)
    parts = {
        "checkpoint_inputs": args.layers * args.hidden * elem * T,
        "mlp_one_layer": run(lambda: layer.mlp(x)),
        "attention_one_layer": run(lambda: layer.self_attn(x, position_embeddings=cos_sin,
                                                           attention_mask=None)[0]),
    }
    ids = torch.randint(0, args.vocab, (1, T), device=device)
    hidden = torch.randn(1, T, args.hidden, device=device, dtype=dtype, requires_grad=True)
    head = base.lm_head
    from trl.trainer.utils import add_fused_lm_head  # noqa: F401  (the fused path is in the model's forward)

    def head_loss():  # the unfused head for scale: logits are what the fused head never materialises
        return torch.nn.functional.cross_entropy(head(hidden).float().view(-1, args.vocab), ids.view(-1))

    parts["unfused_head_for_scale"] = run(head_loss)
    return {k: v / T for k, v in parts.items()}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_patches

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=60))
    torch.set_num_threads(args.threads)
    device = args.device
    if args.patched:
        ddp_patches.apply(tiled_mlp=True, offload=True)
    model = build(args, device)
    ddp = DDP(model, find_unused_parameters=False)
    start = time.monotonic()
    found = search(ddp, args, device)
    found["seconds"] = time.monotonic() - start
    if not args.patched and dist.get_rank() == 0:
        found["parts_per_token"] = parts_per_token(model, args, device)
    if args.patched:
        from ddp_patches import tiled_mlp

        found["tiled_calls"] = tiled_mlp.counts()["tiled_calls"]
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(found, f)
    del ddp, model
    leave_group()


def run(quick: bool = False, *, options: argparse.Namespace | None = None) -> dict:
    """Both sides on 2 gloo ranks; ``quick``: a 64 MiB budget (what ``python -m benchmarks --quick`` runs)."""
    args = options or parser().parse_args(["--budget-mib", "64"] if quick else [])
    common = ["--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--vocab", str(args.vocab),
              "--layers", str(args.layers), "--budget-mib", str(args.budget_mib), "--first-seq", str(args.start),
              "--resolution", str(args.resolution), "--max-tokens", str(args.max_tokens), "--threads",
              str(args.threads), "--probe-tokens", str(args.probe_tokens), "--device", args.device]
    script = os.path.abspath(__file__)
    cuda = args.device == "cuda"
    unpatched = launch_ranks(script, 2, common, threads=args.threads, cuda=cuda, without_library=True)
    patched = launch_ranks(script, 2, common + ["--patched"], threads=args.threads, cuda=cuda)
    ratio = patched["max_seq"] / unpatched["max_seq"] if unpatched["max_seq"] else None
    return {
        "benchmark": NAME,
        "setup": {"device": args.device, "hidden": args.hidden, "intermediate": args.intermediate,
                  "vocab": args.vocab, "layers": args.layers, "budget_mib": args.budget_mib, "ranks": 2,
                  "lora_r": 8, "head": "trl add_fused_lm_head", "resolution": args.resolution,
                  "dtype": "bfloat16" if cuda else "float32"},
        "unpatched": unpatched, "patched": patched, "ratio": ratio,
        "anchor": "ALST (Arctic Long Sequence Training): about 15x longer sequences for Llama-8B on one H100",
    }


def print_table(report: dict) -> None:
    u, p = report["unpatched"], report["patched"]
    print(f"budget {report['setup']['budget_mib']} MiB per rank ({report['setup']['device']}): longest sequence "
          f"unpatched {u['max_seq']}, patched {p['max_seq']} -> {report['ratio'] or 0:.2f}x "
          f"(tiled MLP calls {p.get('tiled_calls')})")
    for name, per_token in (u.get("parts_per_token") or {}).items():
        print(f"  {name:26} {per_token / 1024:8.2f} KiB per token")


def plot(report: dict, path: str) -> str:
    from benchmarks._common import plot_pair

    u, p = report["unpatched"]["probes"], report["patched"]["probes"]
    seqs = sorted({x["seq"] for x in u} | {x["seq"] for x in p})
    by = {name: {x["seq"]: x["peak_bytes"] / 2**20 for x in probes} for name, probes in (("unpatched", u),
                                                                                           ("patched", p))}
    shared = [s for s in seqs if s in by["unpatched"] and s in by["patched"]]
    plot_pair(path, shared, {k: [v[s] for s in shared] for k, v in by.items()},
              [by["unpatched"][s] / by["patched"][s] for s in shared], xlabel="tokens", ylabel="peak MiB per rank",
              ratio_label="unpatched / patched memory", title="Longest sequence under a memory budget", logx=True)
    return path


def summarize(report: dict) -> list[str]:
    s = report["setup"]
    return [f"| longest sequence in {s['budget_mib']} MiB per rank ({s['device'].upper() if s['device'] == 'cuda' else 'CPU'}, "
            f"2 ranks, L={s['layers']} H={s['hidden']}, fused head) | unpatched {report['unpatched']['max_seq']}, "
            f"patched {report['patched']['max_seq']}: {report['ratio'] or 0:.2f}x | (ALST: ~15x on an H100) | "
            "see FIX document |"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget-mib", type=int, default=192)
    p.add_argument("--first-seq", dest="start", type=int, default=1024)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=1 << 20)
    p.add_argument("--probe-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--smoke", action="store_true", help="small model and budget: checks the script only")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--patched", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.hidden, args.intermediate, args.vocab, args.layers = 64, 256, 1024, 2
        args.budget_mib, args.start, args.resolution, args.probe_tokens = 8, 256, 256, 256
    if args.worker_out:
        worker(args)
        return 0
    report = run(options=args)
    finish(sys.modules[__name__], report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
