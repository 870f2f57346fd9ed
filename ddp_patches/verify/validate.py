"""Prove the fix in one command: every scenario unpatched (expected to fail) and patched (must pass).

    python -m ddp_patches validate                              # CPU, gloo, tiny random-init models
    python -m ddp_patches validate --scenarios 'raw-*' --json out.json
    python -m ddp_patches validate --backend nccl --timeout 120     # 2 GPUs; a hang shows as one
    python validate_ddp_fix.py ...                              # the same, from a checkout

Each run happens in its own ``torchrun`` subprocess group with a timeout, so a crash or a hang of the
unpatched code is recorded as an outcome instead of taking this script down. Exit status 0 iff every
patched scenario passes.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

# The folder that holds the ddp_patches package: the ranks import it from there, installed or a checkout.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks_pythonpath() -> str:
    """The user's PYTHONPATH, behind the checkout this harness runs from (an installed copy is found anyway)."""
    import site

    installed = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    first = () if os.path.realpath(PACKAGE_PARENT) in installed else (PACKAGE_PARENT,)
    return os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH")) if p)


def _first_error_line(text: str) -> str:
    # Only error lines count: the library's own WARNING lines quote these messages (the checkpoint swap says why
    # it acts: "'marked as ready twice'"), and a GPU run once reported a device error as one of them.
    # torch 2.14 prints the reducer's message over several "[rankN]: " lines, the marker not on the Error line.
    errors = "\n".join(ln for ln in text.splitlines()
                       if "Error" in ln or "INTERNAL ASSERT" in ln or ln.startswith("[rank"))
    for marker in ("marked as ready twice", "expect_autograd_hooks_", "finished reduction in the prior iteration",
                   "Your training graph has changed", "does not require grad", "invalid device ordinal"):
        if marker in errors:
            return marker
    lines = [ln for ln in text.splitlines() if "Error" in ln]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "failed")[:70]


def run_one(name: str, patched: bool, nproc: int, timeout: float, backend: str = "gloo",
            device: str | None = None) -> dict:
    """Launch one scenario on ``nproc`` ranks; return {'status': pass|fail|error|hang, ...}."""
    with tempfile.TemporaryDirectory(prefix="ddp_validate_") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", "-m", "ddp_patches.verify",
               "--worker", name, "--out", out, "--backend", backend] + (["--patched"] if patched else [])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "DDP_PATCHES_DEVICE": device or ("cuda" if backend == "nccl" else "cpu"),
               "PYTHONPATH": _ranks_pythonpath()}
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
            env.pop(var, None)  # the child group is its own torchrun job
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return {"status": "hang", "detail": f"no result within {timeout:.0f}s", "seconds": timeout}
        seconds = time.monotonic() - start
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
            result["seconds"] = seconds
            return result
        text = stderr + stdout
        return {"status": "error", "detail": _first_error_line(text), "message": _error_message(text),
                "seconds": seconds}


def _stop(proc: subprocess.Popen) -> None:
    """End a timed-out torchrun and its ranks: SIGTERM, which torchrun forwards to its workers (they run in their own
    sessions, so a SIGKILL of torchrun alone can leave a hung rank behind), then SIGKILL after a grace period."""
    proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def _error_message(text: str) -> str:
    """The first sentence of the ranks' error message as a user reads it, with the exception's type ("RuntimeError:
    Expected to mark a variable ready only once."); "" when no rank printed an error line."""
    for line in text.splitlines():
        line = re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
        if re.match(r"^[\w.]*(Error|Exception)\b", line) and ":" in line:
            end = line.find(". ", 20)
            return line[: end + 1 if end > 0 else 160][:160]
    return ""


def worker(name: str, patched: bool, out: str, backend: str = "gloo") -> int:
    """Inside one rank of a child torchrun job."""
    import logging

    import torch.distributed as dist

    import ddp_patches
    from ddp_patches.verify.scenarios import BY_NAME, passed

    logging.basicConfig(level=logging.WARNING)
    for noisy in ("transformers", "accelerate", "peft", "trl", "bitsandbytes"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    scenario = BY_NAME[name]
    if patched:
        ddp_patches.apply(**scenario.apply_kwargs)
    if os.environ.get("DDP_PATCHES_DEVICE") == "cuda":
        from ddp_patches.verify.device import device

        import torch

        torch.cuda.set_device(device())
    dist.init_process_group(backend)
    try:
        result = scenario.run()
        ok = passed(scenario, result)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump({"status": "pass" if ok else "fail", "max_rel_error": result.get("max_rel_error"),
                           "detail": "" if ok else "wrong gradients or ranks out of sync", "result": result}, f)
    finally:
        import gc

        gc.collect()  # free DDP reducers (often in reference cycles) before the group goes: see benchmarks/_common
        dist.destroy_process_group()
    return 0


def _fmt(outcome: dict) -> str:
    return outcome["status"] + (f" ({outcome['detail']})" if outcome.get("detail") else "")


def _ranks(text: str) -> int:
    """--nproc: a whole number of ranks, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks >= 1 (e.g. 2); found {text!r}")
    return value


WEEK = 7 * 24 * 3600  # the longest --timeout taken (subprocess cannot wait an infinite time)


def _seconds(text: str) -> float:
    """--timeout: a number of seconds above 0, at most a week."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= WEEK:  # false for nan too
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 and at most {WEEK} (e.g. 240); "
                                         f"found {text!r}")
    return value


def _check_json_path(path: str) -> None:
    """--json is written after every run: a path that cannot be written is refused before the first."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--json expects a file to write; found a directory: {path!r}")
    if not os.path.isdir(folder):
        raise ValueError(f"--json expects a file in an existing folder; found no folder {folder!r}: create it first")


def _launch(parser: argparse.ArgumentParser) -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun set them (0 and 2 when unset); a bad value is a usage error naming it."""
    from ddp_patches.distributed import env_int

    try:
        return env_int("RANK", 0, minimum=0), env_int("WORLD_SIZE", 2, minimum=1)
    except ValueError as e:
        parser.error(str(e))


def _parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="*", help="comma-separated names or globs (default: all)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--json", help="write every outcome to this JSON file")
    parser.add_argument("--nproc", type=_ranks, default=None, help="ranks per scenario (default: WORLD_SIZE or 2)")
    parser.add_argument("--timeout", type=_seconds, default=240.0, help="seconds before a run counts as a hang")
    parser.add_argument("--skip-unpatched", action="store_true", help="only run the patched side")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo on CPU (default) or nccl with one GPU per rank (CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the ranks' tensors live (default: cuda with nccl, else cpu); with gloo, "
                             "--device cuda puts ranks on the visible GPUs in turn (two ranks may share one)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--patched", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)

    if args.worker:
        return worker(args.worker, args.patched, args.out, args.backend)

    from ddp_patches.verify.scenarios import SCENARIOS

    if args.list:
        for s in SCENARIOS:
            print(f"{s.name:28} {s.description}")
        return 0
    if args.json:
        try:
            _check_json_path(args.json)
        except ValueError as e:
            parser.error(str(e))
    # Under torchrun this script runs once per rank; rank 0 drives, the others have nothing to do.
    rank, world = _launch(parser)
    if rank != 0:
        return 0
    nproc = args.nproc or max(2, world)
    patterns = [p.strip() for p in args.scenarios.split(",") if p.strip()]
    chosen = [s for s in SCENARIOS if any(fnmatch.fnmatch(s.name, p) for p in patterns)]
    if not chosen:
        print(f"no scenario matches {args.scenarios!r}; see --list", file=sys.stderr)
        return 2

    if args.backend == "nccl":
        import torch

        if torch.cuda.device_count() < nproc:
            print(f"--backend nccl needs one GPU per rank: {nproc} ranks, {torch.cuda.device_count()} GPUs visible",
                  file=sys.stderr)
            return 2
    device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device is visible", file=sys.stderr)
            return 2
    where = f"{args.backend}, {'GPU' if device == 'cuda' else 'CPU'}"
    print(f"validate: {len(chosen)} scenarios x (unpatched, patched) on {nproc} ranks ({where})", flush=True)
    rows = []
    for i, s in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {s.name}: {s.description}", flush=True)
        unpatched = ({"status": "skipped"} if args.skip_unpatched
                     else run_one(s.name, False, nproc, args.timeout, args.backend, device))
        if not args.skip_unpatched:
            print(f"    unpatched: {_fmt(unpatched)}", flush=True)
        patched = run_one(s.name, True, nproc, args.timeout, args.backend, device)
        print(f"    patched:   {_fmt(patched)}", flush=True)
        rows.append({"scenario": s.name, "unpatched": unpatched, "patched": patched})

    header = f"{'scenario':28} {'unpatched':44} {'patched':8} {'max grad err':>12} {'time':>7}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        err = r["patched"].get("max_rel_error")
        print(f"{r['scenario']:28} {_fmt(r['unpatched'])[:44]:44} {r['patched']['status']:8} "
              f"{(f'{err:.1e}' if err is not None else '-'):>12} {r['patched'].get('seconds', 0):6.1f}s")
    ok = sum(r["patched"]["status"] == "pass" for r in rows)
    failing_before = sum(r["unpatched"]["status"] in ("error", "hang", "fail") for r in rows)
    before = "skipped" if args.skip_unpatched else f"{failing_before} of {len(rows)} failed"
    print(f"\npatched: {ok} passed, {len(rows) - ok} failed; unpatched: {before}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nproc": nproc, "backend": args.backend, "device": device, "rows": rows}, f, indent=2)
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
