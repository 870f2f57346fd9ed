"""How the cost grows: step time and per-rank peak memory vs sequence length, at world size 1 and 2 (CPU).

    python benchmarks/scaling.py               # seq 128..1024, world sizes 1 and 2
    python benchmarks/scaling.py --quick       # seq 128..512

Same model and configurations as ddp_overhead (benchmarks/_llm_steps.py); compares "patched" with "unpatched"
(the best working configuration without the library). At world size 1 nothing is patched (the library is inert
in one process), which the curves show. Memory: torch.profiler allocation events over one step.
Writes benchmarks/results/scaling.json and .png.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._common import finish, launch_ranks, new_figure, save_figure  # noqa: E402

NAME = "scaling"
STEPS = os.path.join(ROOT, "benchmarks", "_llm_steps.py")


def run(quick: bool = False, *, seqs: list[int] | None = None, worlds: tuple[int, ...] = (1, 2)) -> dict:
    seqs = seqs or ([128, 256, 512] if quick else [128, 256, 512, 1024])
    rounds = 3 if quick else 5
    rows = []
    for world in worlds:
        for ranks in launch_ranks(STEPS, world, ["--seqs", *map(str, seqs), "--rounds", str(rounds), "--memory"]):
            r0 = ranks[0]
            rows.append({
                "world": world, "seq": r0["seq"],
                "step_s": {k: r0["median_s"][k] for k in ("unpatched", "patched")},
                "peak_bytes": {k: r0["peak_bytes"][k] for k in ("unpatched", "patched")},
                "time_ratio": r0["median_s"]["patched"] / r0["median_s"]["unpatched"],
                "mem_ratio": r0["peak_bytes"]["patched"] / r0["peak_bytes"]["unpatched"],
            })
    return {"benchmark": NAME, "setup": {"model": "llama hidden 256, 4 layers, LoRA r=8, checkpointing",
                                         "batch": 4, "rounds": rounds, "backend": "gloo", "threads_per_rank": 1},
            "rows": rows}


def print_table(report: dict) -> None:
    print(f"{'world':>5} {'seq':>5} {'unpatched ms':>13} {'patched ms':>11} {'time ratio':>10} "
          f"{'unpatched MiB':>14} {'patched MiB':>12} {'mem ratio':>9}")
    for r in report["rows"]:
        print(f"{r['world']:>5} {r['seq']:>5} {r['step_s']['unpatched'] * 1000:>13.1f} "
              f"{r['step_s']['patched'] * 1000:>11.1f} {r['time_ratio']:>9.3f}x "
              f"{r['peak_bytes']['unpatched'] / 2**20:>14.1f} {r['peak_bytes']['patched'] / 2**20:>12.1f} "
              f"{r['mem_ratio']:>8.3f}x")


def plot(report: dict, path: str) -> str:
    fig, axes = new_figure(3, 14)
    worlds = sorted({r["world"] for r in report["rows"]})
    for world in worlds:
        rows = [r for r in report["rows"] if r["world"] == world]
        x = [r["seq"] for r in rows]
        for name, style in (("unpatched", "--"), ("patched", "-")):
            axes[0].plot(x, [r["step_s"][name] * 1000 for r in rows], style, marker="o",
                         label=f"{name}, world {world}")
            axes[1].plot(x, [r["peak_bytes"][name] / 2**20 for r in rows], style, marker="o",
                         label=f"{name}, world {world}")
        axes[2].plot(x, [r["time_ratio"] for r in rows], marker="o", label=f"time, world {world}")
        axes[2].plot(x, [r["mem_ratio"] for r in rows], marker="s", linestyle=":", label=f"memory, world {world}")
    axes[0].set_ylabel("median step, ms")
    axes[1].set_ylabel("per-rank peak MiB (one step)")
    axes[2].set_ylabel("patched / unpatched")
    for ax in axes:
        ax.set_xlabel("sequence length")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    return save_figure(fig, axes, "Cost vs sequence length and world size (CPU, LoRA + checkpointing)", path)


def summarize(report: dict) -> list[str]:
    worst_t = max(r["time_ratio"] for r in report["rows"] if r["world"] > 1)
    worst_m = max(r["mem_ratio"] for r in report["rows"] if r["world"] > 1)
    seqs = sorted({r["seq"] for r in report["rows"]})
    return [f"| scaling, seq {seqs[0]}..{seqs[-1]}, world 1 and 2 (CPU) | worst patched/unpatched at world 2: "
            f"time {worst_t:.3f}x, memory {worst_m:.3f}x | grows like unpatched | see plot |"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seqs", type=int, nargs="+")
    p.add_argument("--out-dir")
    args = p.parse_args(argv)
    report = run(args.quick, seqs=args.seqs)
    finish(sys.modules[__name__], report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
