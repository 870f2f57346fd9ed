"""validate_ddp_fix.py end to end on one scenario: the unpatched failure is captured, the patched run passes."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_validate_one_scenario(tmp_path):
    out = tmp_path / "v.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "validate_ddp_fix.py"), "--scenarios", "raw-static-graph-accum",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["unpatched"]["status"] == "error" and "expect_autograd_hooks_" in row["unpatched"]["detail"]
    assert row["patched"]["status"] == "pass" and row["patched"]["max_rel_error"] <= 1e-9
    assert "patched: 1 passed, 0 failed" in proc.stdout


def test_validate_rejects_unknown_scenario():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "validate_ddp_fix.py"), "--scenarios", "nope"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "see --list" in proc.stderr


def test_nccl_without_gpus_says_what_is_missing():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "validate_ddp_fix.py"), "--backend", "nccl",
                           "--scenarios", "raw-*"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "needs one GPU per rank: 2 ranks, 0 GPUs visible" in proc.stderr


def test_validate_subcommand_runs_outside_a_checkout(tmp_path):
    """The harness ships in the package: ``python -m ddp_patches validate`` from any folder, ranks included."""
    proc = subprocess.run([sys.executable, "-m", "ddp_patches", "validate", "--scenarios", "raw-static-graph-accum",
                           "--skip-unpatched"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "patched: 1 passed, 0 failed" in proc.stdout
