"""Running other people's code unchanged, as a user would: commands bounded in time, patched or not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from benchmarks._common import EXIT_ABORT, aborted_only_at_exit as _exit_abort  # noqa: F401 (EXIT_ABORT re-exported)
from tests.harness import ROOT, _free_port

RUNNER = [sys.executable, "-m", "ddp_patches.autoapply"]  # what the ddp-patches-run console script runs
_MARK = "DDP_PATCHES_TEST_RUN"


class Hang(AssertionError):
    pass


class Finished(subprocess.CompletedProcess):
    """A command's outcome; ``hung`` when it (or a rank it started) was still running at the time bound."""

    hung = False


def _marked_pids(mark: str) -> list[int]:
    """Every process whose environment carries ``mark``: torchrun's ranks run in sessions of their own, so a
    process-group kill would miss a rank that hangs after its launcher gave up."""
    pids = []
    needle = f"{_MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _kill_marked(mark: str) -> bool:
    pids = _marked_pids(mark)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return bool(pids)


def run_bounded(cmd: list[str], *, timeout: float, env: dict | None = None, cwd: str = ROOT,
                allow_exit_hang: bool = False) -> Finished:
    """Run ``cmd``; past ``timeout`` kill it and every process it started, then raise Hang.

    ``allow_exit_hang`` returns the output instead (``.hung`` set): for unpatched reference runs, which can hang at
    exit through the very bug tests/test_clients.py checks the library removes.
    """
    mark = uuid.uuid4().hex
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_PATCHES_")}
    full_env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
                     "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                     "PYTHONPATH": ROOT, _MARK: mark,
                     # a rank torchrun stops with SIGTERM would lose what it had buffered, a logged loss included
                     "PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # Files, not pipes: an orphaned rank holding a pipe would block the reader past any timeout.
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=full_env, cwd=cwd,
                                start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            proc.wait(timeout=timeout)
            while _marked_pids(mark) and time.monotonic() < deadline:  # ranks still exiting
                time.sleep(0.5)
            hung = _kill_marked(mark)
        except subprocess.TimeoutExpired:
            hung = True
            _kill_marked(mark)
            proc.wait()
        out.seek(0)
        err.seek(0)
        result = Finished(cmd, proc.returncode, out.read(), err.read())
    result.hung = hung
    if hung and not allow_exit_hang:
        raise Hang(f"{' '.join(cmd[:6])} ... did not exit within {timeout:.0f}s (a hang); last output:\n"
                   f"{(result.stdout + result.stderr)[-3000:]}")
    return result


def aborted_only_at_exit(out: Finished, *, work_done: bool) -> bool:
    """Whether an unpatched reference run failed only through torch's exit-time abort
    (benchmarks._common.aborted_only_at_exit). ``work_done`` is the caller's evidence, read from the run's own
    output, that the script had finished its work (every step logged, every collective done) before the abort;
    torchrun then stops the other rank with SIGTERM, possibly before it said so. Only unpatched reference runs may
    end this way: it is the bug the teardown patch removes, not a failure of the code under test."""
    return work_done and _exit_abort(out.returncode, out.stdout + out.stderr)


def torchrun(script: str, *args: str, patched: bool, nproc: int = 2) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
           script, *args]
    return RUNNER + ["--log-level", "INFO", *cmd] if patched else cmd


def logged_losses(stdout: str) -> list[float]:
    """The per-step 'loss' values the HF Trainer printed (rank 0)."""
    import ast

    losses = []
    for line in stdout.replace("\r", "\n").splitlines():
        start = line.find("{'loss'")
        if start >= 0:
            losses.append(float(ast.literal_eval(line[start:line.index("}", start) + 1])["loss"]))
    return losses
