"""Shared by the benchmarks: launching gloo ranks, measuring CPU peak memory, writing results and plots."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


EXIT_ABORT = "terminate called without an active exception"


def aborted_only_at_exit(returncode: int, output: str) -> bool:
    """A torchrun whose only failure is torch's exit-time abort: a gloo worker still alive, or freeing its last
    work, as the interpreter finalises (NOTE [Groups held by default arguments] and NOTE [A pause at exit] in
    ddp_patches/rescue/teardown.py). No rank raised: the one traceback in ``output`` (stdout and stderr) is torchrun's
    own ChildFailedError. Whether the run's work was done before the abort is for the caller to establish."""
    return (returncode != 0 and EXIT_ABORT in output and "SIGABRT" in output and "ChildFailedError" in output
            and output.count("Traceback (most recent call last)") == 1)


def launch_ranks(script: str, nproc: int, args: list[str], threads: int = 1, cuda: bool = False,
                 without_library: bool = False) -> object:
    """Run ``script --worker-out FILE *args`` on ``nproc`` gloo ranks (torchrun --standalone); return what rank 0
    wrote to FILE (JSON). The ranks see no GPU unless ``cuda``. Raises RuntimeError when the ranks fail.

    ``without_library``: the ranks never call apply(). Such a run can end in torch's own exit-time abort after
    rank 0 wrote its result (the bug the library's teardown patch removes); its result is kept, with a warning.
    A run with the library gets no such allowance."""
    with tempfile.TemporaryDirectory(prefix="ddp_patches_bench_") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script, "--worker-out", out, *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if not cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if without_library and os.path.exists(out) and aborted_only_at_exit(done.returncode, done.stdout + done.stderr):
            logging.getLogger(__name__).warning(
                "%s on %d ranks without the library: torch's exit-time abort after the result was written; "
                "result kept", os.path.basename(script), nproc)
        elif done.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"{os.path.basename(script)} on {nproc} ranks failed (exit {done.returncode}):\n{tail}")
        with open(out) as f:
            return json.load(f)


def leave_group() -> None:
    """Leave the process group once the caller has dropped its DDP models. The other order (a worker returning
    after destroy_process_group, its DDP reducers freed at interpreter exit) hung a gloo rank at exit in about
    one run in three here."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def peak_bytes(fn) -> int:
    """Peak of live tensor bytes allocated while ``fn`` runs on CPU (torch.profiler allocation events in time
    order; frees are negative). Memory allocated before ``fn`` is not counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def cuda_peak_bytes(fn) -> int:
    """Peak of ACTIVE device bytes while ``fn`` runs, beyond what was active before: allocated plus freed blocks
    not yet reusable (owed to another stream), what the next allocation competes with."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()["active_bytes.all.current"]
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["active_bytes.all.peak"] - before


def write_report(name: str, report: dict, out_dir: str = RESULTS) -> str:
    report.setdefault("benchmark", name)
    report.setdefault("date", time.strftime("%Y-%m-%d"))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    from benchmarks import provenance

    if f"benchmarks/results/{name}.json" in provenance.SOURCES:  # the commit and sources it was measured at
        provenance.stamp(path, key=f"benchmarks/results/{name}.json")
    return path


def finish(module, report: dict, out_dir: str | None = None) -> str:
    """A benchmark's last steps: its table on stdout, results/<name>.json, and its plot next to the JSON."""
    module.print_table(report)
    path = write_report(module.NAME, report, out_dir or RESULTS)
    module.plot(report, path.replace(".json", ".png"))
    print(f"wrote {path} and its plot", flush=True)
    return path


def new_figure(ncols: int, width: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, 3.8))


def save_figure(fig, axes, title: str, path: str) -> str:
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_pair(path: str, x: list, series: dict[str, list], ratio: list, *, xlabel: str, ylabel: str,
              ratio_label: str, title: str, logx: bool = False, target: float | None = None) -> str:
    """Left: the curves side by side; right: their ratio, with the target as a dashed line."""
    fig, (left, right) = new_figure(2, 10)
    for label, ys in series.items():
        left.plot(x, ys, marker="o", label=label)
    left.set_xlabel(xlabel)
    left.set_ylabel(ylabel)
    left.legend()
    right.plot(x, ratio, marker="o", color="black")
    if target is not None:
        right.axhline(target, linestyle="--", color="grey", label=f"target {target:g}")
        right.legend()
    right.set_xlabel(xlabel)
    right.set_ylabel(ratio_label)
    if logx:
        for ax in (left, right):
            ax.set_xscale("log", base=2)
    return save_figure(fig, (left, right), title, path)


def cuda_memory_peaks(fn) -> dict:
    """The three peak counters of ``fn`` on CUDA, each beyond its level before: ACTIVE bytes (allocated plus freed
    blocks not yet reusable), ALLOCATED bytes and RESERVED bytes (segments the caching allocator holds), and the
    allocator's retries (a cudaMalloc that failed, cached segments released, tried again). Figures to report beside
    a judge, not a judge: none of them alone decides whether a step fits under a cap (benchmarks/max_seq.py,
    NOTE [The judge is the first OOM, not a peak counter]). Raises what ``fn`` raises (torch.OutOfMemoryError)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    fn()
    torch.cuda.synchronize()
    now = torch.cuda.memory_stats()
    return {name: now[f"{key}.all.peak"] - before[f"{key}.all.current"]
            for name, key in (("active", "active_bytes"), ("allocated", "allocated_bytes"),
                              ("reserved", "reserved_bytes"))} | {
        "alloc_retries": now.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)}
