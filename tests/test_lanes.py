"""The README's "Tested versions" block is generated from the lanes' committed results, and pyproject claims exactly
the versions the lanes test (ddp_patches/verify/lanes.py)."""

from __future__ import annotations

import json
import os
import re
import sys

from ddp_patches.verify import compat, lanes

REGENERATE = "run the lanes and `python -m ddp_patches.verify.lanes record <results>` if the change is intended"

with open(lanes.JSON_PATH, encoding="utf-8") as _f:
    COMMITTED = json.load(_f)


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _requirements() -> dict[str, str]:
    """name -> specifier, from pyproject's dependencies and the hf extra (a plain reader: no tomllib on 3.10)."""
    with open(os.path.join(lanes.ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    return {m.group(1): m.group(2) for m in re.finditer(r'"([A-Za-z_-]+)([<>=!][^"]*)"', text)}


def test_readme_block_is_the_committed_lanes_rendered():
    with open(lanes.README, encoding="utf-8") as f:
        assert compat.readme_block(f.read(), lanes.START, lanes.END) == lanes.render(COMMITTED), REGENERATE


def test_every_lane_is_recorded_and_passed():
    assert [r["lane"] for r in COMMITTED["lanes"]] == list(lanes.lanes()), REGENERATE
    for row in COMMITTED["lanes"]:
        lane = lanes.lanes()[row["lane"]]
        if lane.name != lanes.FLOATING:  # floating pins nothing: its row says what it ran, and when
            assert row["versions"]["torch"].split("+")[0] == lane.torch, REGENERATE
            assert all(row["versions"][p] == lane.pins[p] for p in lanes.LIBRARIES), REGENERATE
        assert row["validate"]["passed"] == row["validate"]["total"] > 0 and row["tests"]["ok"], row


def test_pyproject_claims_exactly_the_tested_range():
    req = _requirements()
    torch_versions = [_minor(r["versions"]["torch"]) for r in COMMITTED["lanes"]]
    low, high = min(torch_versions), max(torch_versions)
    assert req["torch"] == f">={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}", req["torch"]
    for package in lanes.LIBRARIES:
        oldest = min(_minor(r["versions"][package]) for r in COMMITTED["lanes"])
        assert req[package].startswith(f">={oldest[0]}.{oldest[1]}"), (package, req[package])


def test_ci_runs_every_lane():
    with open(os.path.join(lanes.ROOT, ".ci", "run"), encoding="utf-8") as f:
        script = f.read()
    for name in lanes.lanes():
        if name not in ("main", lanes.FLOATING):  # NOTE [Newest pinned, newest floating]
            assert f"ddp_patches.verify.lanes run {name}" in script


def test_a_lane_runs_with_a_relative_workdir(tmp_path, monkeypatch):
    """.ci/run passes ``--workdir .lanes``: the venv's python path was relative and the version query, which runs
    with cwd="/", did not find it (FileNotFoundError after the whole lane had run). The venv here is this
    interpreter put in place of the install (minutes, a torch download); one scenario and one test run.

    Not a symlink to sys.executable: inside a virtualenv the link starts the base interpreter, which finds no
    pyvenv.cfg beside the link and so none of the venv's packages (no torch). A script that execs this very
    interpreter by its path keeps its environment, in a venv and in a global interpreter alike."""
    def link_this_interpreter(lane, venv):
        os.makedirs(os.path.join(venv, "bin"))
        python = os.path.join(venv, "bin", "python")
        with open(python, "w", encoding="utf-8") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        os.chmod(python, 0o755)

    lane = lanes.Lane("tiny", torch="-", pins={}, why="a relative workdir", scenarios="raw-reentrant-twice",
                      tests=("tests/test_lanes.py::test_pyproject_claims_exactly_the_tested_range",))
    monkeypatch.setattr(lanes, "install", link_this_interpreter)
    monkeypatch.chdir(tmp_path)
    result = lanes.run(lane, "relative-lanes")
    assert lanes.passed(result), result
    assert result["versions"]["torch"] and (tmp_path / "relative-lanes" / "tiny.result.json").exists()
