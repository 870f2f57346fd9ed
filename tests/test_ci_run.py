""".ci/run, dry: the script itself runs in a copy of its folder with a stand-in ``python3`` first on PATH that records
each call and succeeds, or fails on one of them, so the stage summary is checked in a second, not in CI's 45 minutes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["install", "main lane", "deepspeed install", "deepspeed tests", "newest lane", "oldest lane"]
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [[ "$1" == "-m" && "$2" == "venv" ]]; then mkdir -p "$3/bin" && : > "$3/bin/activate"; fi
if [[ "$1" == "--version" ]]; then echo "Python 3.x (stand-in)"; fi
if [[ -n "${FAIL_ON:-}" && "$*" == *"$FAIL_ON"* ]]; then exit 3; fi
exit 0
"""


def _dry_run(tmp_path, fail_on: str = "") -> tuple[subprocess.CompletedProcess, list[str]]:
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci" / "lanes").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(os.path.join(ROOT, ".ci", "run"), repo / ".ci" / "run")
    shutil.copy(os.path.join(ROOT, ".ci", "lanes", "main.txt"), repo / ".ci" / "lanes" / "main.txt")
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls"
    env = {k: v for k, v in os.environ.items() if k not in ("DDP_PATCHES_CI_VENV", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", CALLS=str(calls), FAIL_ON=fail_on)
    out = subprocess.run(["bash", str(repo / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)
    return out, calls.read_text().splitlines() if calls.exists() else []


def _summary(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    return lines[lines.index("ci: seconds per stage:") + 1:]


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, ".ci", "run")]).returncode == 0


def test_every_stage_has_its_own_seconds_in_one_summary(tmp_path):
    out, calls = _dry_run(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = _summary(out.stdout)
    assert [re.sub(r"\s+\d+s$", "", line.removeprefix("ci:   ")) for line in summary] == [*STAGES, "total"], summary
    # the README's install and test commands, as written there
    assert "-m pip install --quiet --disable-pip-version-check -c .ci/lanes/main.txt -e .[test]" in calls
    assert calls.count("-m pytest -q tests") == 1 and "-m pytest -q tests -m deepspeed" in calls
    assert calls[-2:] == ["-m tools.lanes run newest --workdir .lanes", "-m tools.lanes run oldest --workdir .lanes"]


@pytest.mark.parametrize("fail_on,failed", [("tests -m deepspeed", "deepspeed tests"),
                                            ("-m pytest -q tests", "main lane")])
def test_a_failing_stage_still_prints_the_summary_and_the_exit_status(tmp_path, fail_on, failed):
    out, calls = _dry_run(tmp_path, fail_on)
    assert out.returncode == 3, out.stdout + out.stderr
    summary = _summary(out.stdout)
    done = STAGES[:STAGES.index(failed)]
    assert [line.removeprefix("ci:   ").split("  ")[0].strip() for line in summary] == [*done, failed, "total"]
    assert summary[len(done)].endswith("FAILED (exit 3)"), summary
    assert not [call for call in calls if "tools.lanes" in call]  # set -e: nothing after the failure ran
