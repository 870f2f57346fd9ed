"""Running other people's code unchanged, as a user would: commands bounded in time, patched or not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.harness import ROOT, _free_port

RUNNER = [sys.executable, "-m", "ddp_patches.autoapply"]  # what the ddp-patches-run console script runs


class Hang(AssertionError):
    pass


def run_bounded(cmd: list[str], *, timeout: float, env: dict | None = None, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; past ``timeout`` kill the whole group (ranks too) and raise Hang."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_PATCHES_")}
    full_env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
                     "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                     "PYTHONPATH": ROOT})
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise Hang(f"{' '.join(cmd[:6])} ... did not exit within {timeout:.0f}s (a hang); last output:\n"
                   f"{(out + err)[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
