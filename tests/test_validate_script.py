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


def _one_clear_line(code, stderr: str, expected: str) -> None:
    """A usage error as argparse gives it: exit 2, no traceback, one error line that says ``expected``."""
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1] and expected in errors[0], stderr


@pytest.mark.parametrize("args,expected", [
    (["--nproc", "-2"], "argument --nproc: expected a whole number of ranks >= 1"),
    (["--nproc", "0"], "argument --nproc: expected a whole number of ranks >= 1"),
    (["--timeout", "-1"], "argument --timeout: expected a number of seconds > 0"),
    (["--timeout", "inf"], "argument --timeout: expected a number of seconds > 0"),
    (["--json", "."], "--json expects a file to write; found a directory"),
    (["--json", os.path.join("no", "such", "folder", "out.json")], "--json expects a file in an existing folder"),
], ids=["nproc-negative", "nproc-0", "timeout-negative", "timeout-inf", "json-directory", "json-missing-folder"])
def test_validate_rejects_bad_arguments_before_any_run(capsys, args, expected):
    """Each is a usage error before any rank starts (``--scenarios nope`` would otherwise end the run at once):
    --nproc -2 used to launch torchrun and report the patched code as failing, --nproc 0 ran with the default,
    a bad --timeout reported every run as a hang (or raised), a bad --json path raised after every run."""
    from ddp_patches.verify.validate import main

    with pytest.raises(SystemExit) as exit:
        main([*args, "--scenarios", "nope"], prog="python -m ddp_patches validate")
    _one_clear_line(exit.value.code, capsys.readouterr().err, expected)


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "RANK"])
def test_validate_names_a_bad_launch_variable(monkeypatch, capsys, variable):
    from ddp_patches.verify.validate import main

    monkeypatch.setenv(variable, "abc")
    with pytest.raises(SystemExit) as exit:
        main(["--scenarios", "nope"], prog="python -m ddp_patches validate")
    _one_clear_line(exit.value.code, capsys.readouterr().err, f"expected {variable} to be a whole number")


def test_validate_command_with_a_negative_nproc_is_one_line():
    """The same through ``python -m ddp_patches validate``, the process a user runs."""
    proc = subprocess.run([sys.executable, "-m", "ddp_patches", "validate", "--nproc", "-2", "--scenarios", "raw-*"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    _one_clear_line(proc.returncode, proc.stderr, "found '-2'")
