"""PyTorch Lightning's ``Trainer(strategy=DDPStrategy(...))`` and Lightning Fabric, unchanged, on 2 CPU ranks (gloo).

Lightning starts its second rank itself, by running the user's script again (its subprocess launcher), so the
library must reach that process from ``ddp_patches.apply()`` at the top of the script, or from
``ddp-patches-run python script.py``. Each pattern (tests/lightning_script.py) fails unpatched the way users report it
(casanovo#512: ``DDPStrategy(static_graph=True)`` with ``accumulate_grad_batches`` ends in the reducer's
``expect_autograd_hooks_`` INTERNAL ASSERT) and, patched, trains with the gradients before every optimizer step and
the final weights equal to one process on the global batch (different data per rank).

Lightning is not in this project's dependencies: these tests run in the lightning lane's own venv
(``python -m tools.lanes run lightning``, .ci/lanes/lightning.txt, docs/compatibility.md); elsewhere they are skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed: these tests run in the lightning lane's venv "
                                        "(`python -m tools.lanes run lightning`, docs/compatibility.md)")

import torch  # noqa: E402

from tests import lightning_script as script  # noqa: E402

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "lightning_script.py")
PARITY = 1e-12  # fp64
# What each pattern ends in without the library. rank-branch hangs: rank 0 waits in an all-reduce rank 1 never
# joins; once that times out (20 s here, 30 min by default with gloo), rank 1 raises at its next step, Lightning
# rewording the reducer's "Expected to have finished reduction". The launch is stopped at the first of these lines.
UNPATCHED = {
    "static-accum": "expect_autograd_hooks_ INTERNAL ASSERT FAILED",
    "reentrant-unused": "Expected to mark a variable ready only once",
    "rank-branch": "parameters that were not used in producing the loss",
    "fabric-static": "expect_autograd_hooks_ INTERNAL ASSERT FAILED",
}


def _launch(tmp_path, pattern: str, *, apply: bool, runner: tuple[str, ...] = (), timeout: float = 300,
            stop_at: str | None = None, collective_timeout: float | None = None):
    """Run the script as a user would; returns (exit status, output, the ranks' results or None). With ``stop_at``,
    the launch is killed as soon as its output shows that text (an unpatched rank's error: the other rank would wait
    for it until the process group's timeout); the status is then None."""
    out = tmp_path / pattern
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    for name in ("DDP_PATCHES_APPLY", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(name, None)
    cmd = [*runner, sys.executable, SCRIPT, pattern, str(out), *(["--apply"] if apply else []),
           *([f"--collective-timeout={collective_timeout}"] if collective_timeout else [])]
    # The launch and the rank Lightning starts share a session, killed as one (a hang must not outlive the test).
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if stop_at is not None and stop_at in "".join(lines):
            break
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=10)
        return None, "".join(lines), None
    reader.join(timeout=10)
    ranks = [out / f"rank{r}.pt" for r in range(script.WORLD)]
    results = [torch.load(p) for p in ranks] if all(p.exists() for p in ranks) else None
    return proc.returncode, "".join(lines), results


def _assert_parity(pattern: str, results: list[dict], output: str) -> None:
    ref = script.reference(pattern)
    for rank, got in enumerate(results):
        assert got["applied"], (rank, output[-3000:])
        assert len(got["grads"]) == len(ref["grads"]) == script.STEPS
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
            for name in r:
                assert torch.allclose(g[name], r[name], rtol=0, atol=PARITY), (pattern, rank, step, name)
                assert r[name].abs().max() > 0, (pattern, name)  # every trainable parameter has a gradient
        for name, w in ref["weights"].items():
            assert torch.allclose(got["weights"][name], w, rtol=0, atol=PARITY), (pattern, rank, name)


@pytest.mark.parametrize("pattern", script.PATTERNS)
def test_unpatched_fails_as_users_report(tmp_path, pattern):
    code, output, results = _launch(tmp_path, pattern, apply=False, stop_at=UNPATCHED[pattern], collective_timeout=20)
    assert code != 0 and results is None, output[-3000:]
    assert UNPATCHED[pattern] in output, output[-3000:]


@pytest.mark.parametrize("pattern", script.PATTERNS)
def test_apply_at_the_top_reaches_lightnings_ranks_with_parity(tmp_path, pattern):
    code, output, results = _launch(tmp_path, pattern, apply=True)
    assert code == 0 and results, output[-3000:]
    _assert_parity(pattern, results, output)


def test_ddp_patches_run_reaches_the_ranks_lightning_starts(tmp_path):
    """``ddp-patches-run python script.py``, the script without apply(): both ranks are patched (rank 1 is started
    by Lightning, not by the runner) and casanovo#512's setting trains with parity."""
    runner = shutil.which("ddp-patches-run", path=os.path.dirname(sys.executable)) or shutil.which("ddp-patches-run")
    assert runner, "pip install -e . installs the ddp-patches-run console script"
    code, output, results = _launch(tmp_path, "static-accum", apply=False, runner=(runner,))
    assert code == 0 and results, output[-3000:]
    _assert_parity("static-accum", results, output)


def test_doctor_names_static_graph_with_accumulation_in_a_trainer():
    """``diagnose(args=trainer)``: a Lightning Trainer is read like TrainingArguments (casanovo#512's setting)."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from ddp_patches.doctor import diagnose

    def trainer(**kwargs):
        return L.Trainer(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, **kwargs)

    finding = next(f for f in diagnose(None, trainer(strategy=DDPStrategy(static_graph=True),
                                                     accumulate_grad_batches=4)).findings
                   if f.code == "lightning-static-graph-accumulation")
    assert finding.severity == "error" and "expect_autograd_hooks_" in finding.failure
    assert "accumulate_grad_batches=4" in finding.setting and "static_graph=False" in finding.fix
    quiet = [diagnose(None, trainer(strategy=DDPStrategy(static_graph=True))),
             diagnose(None, trainer(strategy=DDPStrategy(), accumulate_grad_batches=4))]
    assert all("lightning-static-graph-accumulation" not in d.codes() for d in quiet)
