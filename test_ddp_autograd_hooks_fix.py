"""Check ddp_patches where you train: the DDP failures it fixes, run under your torchrun, on your GPUs.

    torchrun --nproc_per_node=2 test_ddp_autograd_hooks_fix.py              # patched: every pattern must pass
    torchrun --nproc_per_node=2 test_ddp_autograd_hooks_fix.py --unpatched  # what you see without the library
    python test_ddp_autograd_hooks_fix.py                                   # one process: apply() is a no-op

Backend: NCCL with one GPU per rank when CUDA has a GPU for each local rank, else gloo on the CPU (--backend).
Patterns, each run with the library applied and checked against a single-process reference:

  static-graph-accum       static_graph=True with gradient accumulation under no_sync()
  reentrant-find-unused    reentrant checkpoints (use_reentrant=True) with find_unused_parameters=True
  unused-on-some-ranks     a branch only rank 0 takes (find_unused_parameters=False): the others leave it unused
  lora-checkpointing       tiny random Llama, PEFT LoRA, reentrant gradient checkpointing, find_unused=True
                           (needs transformers and peft; skipped with a line without them)

Every rank trains on its own data; every iteration, every rank's gradients are compared with one model copy (same
initialisation) run on the global batch (all ranks' batches, loss averaged as DDP does). Rank 0 prints a table:
pattern, outcome, max relative gradient error. Exit status 0 iff every pattern passes.

--unpatched runs the same patterns without the library, each in its own torchrun job of LOCAL_WORLD_SIZE ranks on
this node (a DDP reducer error or a hang leaves a process group unusable), and prints each one's error message or
"hang" after --timeout seconds. It exits 1 when any pattern fails, which is what it is expected to do.

The patterns and the parity loop are those of validate_ddp_fix.py (ddp_patches/verify/): this file runs them in the
ranks your torchrun starts instead of spawning its own.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this checkout's ddp_patches, installed or not

# (pattern, scenario of ddp_patches/verify/scenarios.py, modules it needs)
PATTERNS = (
    ("static-graph-accum", "raw-static-graph-accum", ()),
    ("reentrant-find-unused", "raw-reentrant-find-unused", ()),
    ("unused-on-some-ranks", "raw-unused-on-one-rank", ()),
    ("lora-checkpointing", "llama-lora-trainer-ddp", ("transformers", "peft")),
)


def _parser() -> argparse.ArgumentParser:
    from ddp_patches.verify.validate import _seconds

    parser = argparse.ArgumentParser(prog="test_ddp_autograd_hooks_fix.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unpatched", action="store_true",
                        help="run the patterns without the library and report what fails (exits 1 when any does)")
    parser.add_argument("--patterns", default=",".join(p for p, _, _ in PATTERNS),
                        help="comma-separated patterns to run (default: all)")
    parser.add_argument("--timeout", type=_seconds, default=300.0,
                        help="seconds one pattern may take before it counts as a hang (default: 300)")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="auto (default): nccl when CUDA has a GPU per local rank, else gloo on the CPU")
    return parser


def _missing(modules: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [m for m in modules if importlib.util.find_spec(m) is None]


def _local_world() -> int:
    from ddp_patches.distributed import env_int

    return env_int("LOCAL_WORLD_SIZE", env_int("WORLD_SIZE", 1, minimum=1), minimum=1)


def _backend(choice: str, parser: argparse.ArgumentParser) -> tuple[str, str]:
    """(backend, device) for the ranks; a usage error names what is missing."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough = gpus >= _local_world()
    if choice == "nccl" and not enough:
        parser.error(f"--backend nccl expects one GPU per local rank; found {gpus} GPUs for {_local_world()} "
                         "ranks: start fewer ranks (--nproc_per_node) or use --backend gloo")
    if choice == "nccl" or (choice == "auto" and enough and gpus > 0):
        return "nccl", "cuda"
    return "gloo", "cpu"


# -- one process: the library changes nothing ------------------------------------------------------------------
def single_process() -> int:
    """apply() in a process that is not distributed: gradients bit-identical to without it; revert() puts every
    original back by identity."""
    import torch

    import ddp_patches
    from ddp_patches._registry import REGISTRY
    from ddp_patches.verify.raw_models import CheckpointStack, CheckpointTwice, raw_batch, raw_loss

    def gradients() -> list[torch.Tensor]:
        grads = []
        for build in (lambda: CheckpointTwice(use_reentrant=True), lambda: CheckpointStack(use_reentrant=False)):
            torch.manual_seed(0)
            model = build().double()
            raw_loss(model, raw_batch(0, 0, 0)).backward()
            grads += [p.grad.clone() for p in model.parameters()]
        return grads

    before = gradients()
    report = ddp_patches.apply()
    patched = [(p.owner, p.name, p.original) for p in REGISTRY._patches.values()]
    during = gradients()
    ddp_patches.revert()
    after = gradients()
    same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(before, during, after))
    restored = all(vars(owner)[name] is original for owner, name, original in patched)
    print(f"one process: apply() installed {len(report.installed)} patches; gradients with it "
          f"{'bit-identical' if same else 'DIFFERENT'} to without it; revert() "
          f"{'restored every original' if restored else 'LEFT A PATCH IN PLACE'}")
    if not (same and restored):
        print("FAIL: in a process that is not distributed the library must change nothing", file=sys.stderr)
        return 1
    print("the library is a no-op here; the DDP part needs torchrun with 2 or more ranks: "
          "torchrun --nproc_per_node=2 test_ddp_autograd_hooks_fix.py")
    return 0


# -- patched: the patterns in the ranks torchrun started --------------------------------------------------------
def _table(rows: list[tuple[str, str, str, str, str]]) -> str:
    """pattern, outcome, max relative gradient error (over every rank and iteration), seconds, detail."""
    header = f"{'pattern':24} {'outcome':8} {'max grad err':>12} {'time':>6}  detail"
    lines = [header, "-" * len(header)]
    lines += [f"{name:24} {outcome:8} {err:>12} {secs:>6}  {detail}".rstrip()
              for name, outcome, err, secs, detail in rows]
    return "\n".join(lines)


def _errors_key(what: str, rank: int) -> str:
    return f"ddp_patches_selftest/{what}/error/{rank}"


def _posted_error(what: str, world: int) -> str:
    """The first error a rank posted in torchrun's key-value store for this pattern ("" when none did): a rank that
    raised while another sits in a collective is the cause worth printing, and the store needs no collective."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    for r in range(world):
        if store.check([_errors_key(what, r)]):
            return f"rank {r}: {store.get(_errors_key(what, r)).decode()}"
    return ""


def _watchdog(seconds: float, what: str, rank: int, world: int, rows: list):
    """A timer that ends this process (``os._exit``) when a pattern outlasts ``seconds``: a hung collective cannot
    be interrupted from Python, and the run must end with an answer."""
    import threading

    def fire() -> None:
        try:
            detail = _posted_error(what, world)
        except Exception:  # the store went with a rank that exited: say what is known
            detail = ""
        outcome = "error" if detail else "hang"
        detail = f"{detail}; " if detail else ""
        if rank == 0:
            rows.append((what, outcome, "-", f"{seconds:.0f}s",
                         f"{detail}no result from every rank within {seconds:.0f}s"))
            print("\n" + _table(rows), flush=True)
        print(f"rank {rank}: {what}: {detail}no result from every rank within {seconds:.0f}s (hang); exiting",
              file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    return timer


def patched_run(chosen: list[tuple[str, str, tuple]], timeout: float, backend: str, device: str) -> int:
    import datetime
    import gc
    import logging
    import time

    import torch
    import torch.distributed as dist

    import ddp_patches
    from ddp_patches.verify.scenarios import BY_NAME, passed

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for noisy in ("transformers", "accelerate", "peft", "trl", "bitsandbytes"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ["DDP_PATCHES_DEVICE"] = device  # ddp_patches.verify.device: cuda:LOCAL_RANK or the CPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny models are built from configs: nothing to download
    ddp_patches.apply()
    if device == "cuda":
        from ddp_patches.verify.device import device as rank_device

        torch.cuda.set_device(rank_device())
    limit = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend, timeout=limit)
    rank, world = dist.get_rank(), dist.get_world_size()
    status = dist.new_group(backend="gloo", timeout=limit)  # outcomes travel here, whatever the training backend
    if rank == 0:
        print(f"ddp_patches applied; {len(chosen)} patterns on {world} ranks ({backend}, "
              f"{'GPU' if device == 'cuda' else 'CPU'}), each rank on its own data", flush=True)
    rows: list[tuple[str, str, str, str]] = []
    failed = broken = False
    for name, scenario_name, needs in chosen:
        if broken:
            rows.append((name, "not run", "-", "-", "an earlier failure left the process group unusable"))
            continue
        missing = _missing(needs)
        if missing:
            rows.append((name, "skipped", "-", "-", f"needs {' and '.join(missing)} (pip install -e '.[hf]')"))
            continue
        scenario = BY_NAME[scenario_name]
        start = time.monotonic()
        timer = _watchdog(timeout, name, rank, world, rows)
        timer.start()
        try:
            result = scenario.run()
            mine = ("pass" if passed(scenario, result) else "fail", float(result["max_rel_error"]), "")
        except Exception as e:  # reported below, with every rank's outcome
            first = (str(e).strip().splitlines() or [""])[0]
            mine = ("error", float("nan"), f"{type(e).__name__}: {first[:150]}")
            dist.distributed_c10d._get_default_store().set(_errors_key(name, rank), mine[2])
        outcomes: list = [None] * world
        dist.all_gather_object(outcomes, mine, group=status)
        timer.cancel()
        worst = max(outcomes, key=lambda o: ("pass", "fail", "error").index(o[0]))
        error = max(o[1] for o in outcomes)
        detail = worst[2] or ("" if worst[0] == "pass" else
                              f"gradient error above {scenario.tolerance:g} or ranks out of sync")
        rows.append((name, worst[0], f"{error:.1e}", f"{time.monotonic() - start:.1f}s", detail))
        failed |= worst[0] != "pass"
        broken |= worst[0] == "error"
        if rank == 0:
            print(f"  {name}: {worst[0]}", flush=True)
    gc.collect()  # free DDP reducers (often in reference cycles) before the group goes
    if not broken:
        dist.destroy_process_group()
    if rank == 0:
        print("\n" + _table(rows))
        ran = [r for r in rows if r[1] not in ("skipped", "not run")]
        print(f"\npatched: {sum(r[1] == 'pass' for r in ran)} of {len(ran)} patterns passed"
              + (f", {len(rows) - len(ran)} not run" if len(ran) < len(rows) else ""), flush=True)
    if broken:
        sys.stdout.flush()
        os._exit(1)  # a rank may still sit in a collective of the broken group: do not wait for it at exit
    return 1 if failed else 0


# -- unpatched: each pattern in its own torchrun job, as users see it -------------------------------------------
def unpatched_run(chosen: list[tuple[str, str, tuple]], timeout: float, backend: str, device: str) -> int:
    from ddp_patches.distributed import env_int
    from ddp_patches.verify.validate import run_one

    if env_int("RANK", 0, minimum=0) != 0:
        return 0  # rank 0 drives; each pattern runs in a job of its own
    nproc = _local_world()
    print(f"without ddp_patches: {len(chosen)} patterns, each in its own torchrun job of {nproc} ranks ({backend}, "
          f"{'GPU' if device == 'cuda' else 'CPU'}), a hang cut after {timeout:.0f}s", flush=True)
    rows = []
    for name, scenario_name, needs in chosen:
        missing = _missing(needs)
        if missing:
            rows.append((name, "skipped", "-", "-", f"needs {' and '.join(missing)} (pip install -e '.[hf]')"))
            continue
        outcome = run_one(scenario_name, False, nproc, timeout, backend, device)
        err = outcome.get("max_rel_error")
        detail = outcome.get("message") or outcome.get("detail", "")
        rows.append((name, outcome["status"], f"{err:.1e}" if err is not None else "-",
                     f"{outcome.get('seconds', 0):.1f}s", detail))
        print(f"  {name}: {outcome['status']}", flush=True)
    print("\n" + _table(rows))
    ran = [r for r in rows if r[1] != "skipped"]
    failing = sum(r[1] != "pass" for r in ran)
    print(f"\nunpatched: {failing} of {len(ran)} patterns fail without the library"
          + (" (expected: run without --unpatched to see them pass)" if failing else ""))
    return 1 if failing else 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    names = [p.strip() for p in args.patterns.split(",") if p.strip()]
    known = {p for p, _, _ in PATTERNS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"--patterns expects names among {', '.join(sorted(known))}; found {args.patterns!r}")
    chosen = [p for p in PATTERNS if p[0] in names]
    from ddp_patches.distributed import env_int

    try:
        world = env_int("WORLD_SIZE", 1, minimum=1)
    except ValueError as e:
        parser.error(str(e))
    if world < 2:
        return single_process()
    try:
        backend, device = _backend(args.backend, parser)
    except ValueError as e:  # LOCAL_WORLD_SIZE that is not a whole number
        parser.error(str(e))
    run = unpatched_run if args.unpatched else patched_run
    return run(chosen, args.timeout, backend, device)


if __name__ == "__main__":
    sys.exit(main())
