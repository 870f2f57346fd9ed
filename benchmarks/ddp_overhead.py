"""DDP step overhead of the patches: patched vs the best working unpatched configuration, on 2 CPU ranks.

    python benchmarks/ddp_overhead.py            # Llama-shaped, hidden 256, 4 layers, LoRA r=8, batch 4 x 256
    python benchmarks/ddp_overhead.py --quick

Three DDP models on each rank, stepped in interleaved rounds (see benchmarks/_llm_steps.py): "unpatched"
(non-reentrant checkpointing, find_unused=False), "patched" (apply(), reentrant kwargs, DDP's defaults kept)
and "patched-fu-true" (apply() with find_unused=True, as the Trainer passes for a PeftModel). Reports the median
step-time ratios patched / unpatched (target <= 1.03x) and patched-fu-true / patched (the cost of DDP's search
for unused parameters, which the last release forced on every run).
Writes benchmarks/results/ddp_overhead.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._common import finish, launch_ranks, new_figure, save_figure  # noqa: E402

NAME = "ddp_overhead"
TARGET = 1.03
STEPS = os.path.join(ROOT, "benchmarks", "_llm_steps.py")


def run(quick: bool = False, *, seq: int = 256, rounds: int | None = None) -> dict:
    rounds = rounds or (6 if quick else 20)
    ranks = launch_ranks(STEPS, 2, ["--seqs", str(seq), "--rounds", str(rounds)])[0]
    # Per round, a rank's step time; the slower rank sets the pace, so compare the ranks' per-round maxima.
    per_round = {k: [max(r["all_s"][k][i] for r in ranks) for i in range(rounds)] for k in ranks[0]["all_s"]}
    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratio = med["patched"] / med["unpatched"]
    fu_cost = med["patched-fu-true"] / med["patched"]
    return {
        "benchmark": NAME,
        "setup": {"model": "llama hidden 256, 4 layers, LoRA r=8, checkpointing", "batch": 4, "seq": seq,
                  "ranks": 2, "backend": "gloo", "threads_per_rank": 1, "rounds": rounds},
        "targets": {"patched_over_unpatched_max": TARGET},
        "median_step_s": med,
        "per_round_s": per_round,
        "patched_over_unpatched": ratio,
        "find_unused_cost": fu_cost,
        "misses": [f"patched/unpatched {ratio:.3f}x > {TARGET}x"] if ratio > TARGET else [],
    }


def print_table(report: dict) -> None:
    for name, s in report["median_step_s"].items():
        print(f"{name:18} median step {s * 1000:8.1f} ms")
    flag = "  <- " + "; ".join(report["misses"]) if report["misses"] else ""
    print(f"patched / unpatched: {report['patched_over_unpatched']:.3f}x (target <= {TARGET}x){flag}")
    print(f"cost of find_unused=True (patched-fu-true / patched with DDP defaults): {report['find_unused_cost']:.3f}x")


def plot(report: dict, path: str) -> str:
    fig, (left, right) = new_figure(2, 10)
    names = list(report["per_round_s"])
    left.boxplot([[s * 1000 for s in report["per_round_s"][n]] for n in names])
    left.set_xticks(range(1, len(names) + 1), names)
    left.set_ylabel("step time, ms (per round, slower rank)")
    ratios = {"patched / unpatched": report["patched_over_unpatched"],
              "find_unused cost": report["find_unused_cost"]}
    right.bar(list(ratios), list(ratios.values()), color=["tab:blue", "tab:orange"])
    right.axhline(TARGET, linestyle="--", color="grey", label=f"target {TARGET}")
    right.set_ylim(0.9, max(1.1, max(ratios.values()) + 0.02))
    right.set_ylabel("median ratio")
    right.legend()
    return save_figure(fig, (left, right), "DDP step overhead (CPU, 2 ranks, LoRA + checkpointing)", path)


def summarize(report: dict) -> list[str]:
    status = "missed" if report["misses"] else "met"
    return [f"| DDP step, patched / best unpatched (CPU, 2 ranks) | {report['patched_over_unpatched']:.3f}x | "
            f"<= {TARGET}x | {status} |",
            f"| find_unused=True / DDP defaults, both patched (the last release forced True) | "
            f"{report['find_unused_cost']:.3f}x | "
            "(cost shown) | — |"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int)
    p.add_argument("--out-dir")
    args = p.parse_args(argv)
    report = run(args.quick, seq=args.seq, rounds=args.rounds)
    finish(sys.modules[__name__], report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
