"""The "Tested versions" block of docs/compatibility.md is generated from the lanes' committed results, and pyproject
claims exactly the versions the lanes test (tools/lanes.py)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from tools import compat, lanes

REGENERATE = "run the lanes and `python -m tools.lanes record <results>` if the change is intended"

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


@pytest.mark.docs
def test_docs_block_is_the_committed_lanes_rendered():
    assert compat.read_block(lanes.PAGE, lanes.START, lanes.END) == lanes.render(COMMITTED), REGENERATE


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
    for name, lane in lanes.lanes().items():
        if name not in ("main", lanes.FLOATING) and lane.ci:  # NOTE [Newest pinned, newest floating]
            assert f"tools.lanes run {name}" in script
        elif not lane.ci:  # NOTE [A tool's lane, by hand]
            assert f"tools.lanes run {name}" not in script


@pytest.mark.slow
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


def test_lane_pins_come_from_the_requirement_files():
    """One source: each CI lane's torch and libraries are its .ci/lanes/<lane>.txt, the file pip and a machine's
    set-up read too."""
    for name in ("main", "newest", "oldest", "lightning"):
        pinned = lanes.pins(name)
        lane = lanes.lanes()[name]
        assert lane.torch == pinned["torch"] and all(pinned[k] == v for k, v in lane.pins.items()), name
    with open(os.path.join(lanes.ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert ".ci/lanes/main.txt" in f.read()


def test_the_lightning_lane_is_the_main_lanes_pins_and_lightning():
    """NOTE [A tool's lane, by hand]: the tool's lane differs from the main lane by the tool alone (DeepSpeed aside,
    the main lane's alone), so a failure there is the tool's, not another version's."""
    main = {k: v for k, v in lanes.pins("main").items() if k != "deepspeed"}
    lightning = lanes.pins("lightning")
    assert lightning == {**main, "lightning": lightning["lightning"]}
    assert lanes.lanes()["lightning"].packages == ("lightning",) and not lanes.lanes()["lightning"].ci


def _bare_venv(path) -> str:
    """A venv without its own pip (the base interpreter's pip serves it): seconds, no download."""
    import subprocess

    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", "--system-site-packages", str(path)], check=True)
    return str(path)


def test_a_lane_venv_clears_a_machine_wide_constraint(tmp_path, monkeypatch, capsys):
    """A fresh machine caps pip machine-wide (an XDG pip.conf naming torch<=2.14.1): a lane's venv clears that one
    key in its own pip.conf and says so in one line; where nothing is configured it writes nothing; where the cap
    comes from a variable that outranks the venv's file, it stops and names it.
    NOTE [A lane's pins beat the machine's cap]"""
    cap = tmp_path / "xdg" / "pip"
    cap.mkdir(parents=True)
    (cap / "constraints.txt").write_text("# the machine's cap\ntorch<=2.14.1\ntorchvision<=0.29.1\n")
    (cap / "pip.conf").write_text(f"[global]\nconstraint = {cap / 'constraints.txt'}\n")
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    monkeypatch.delenv("PIP_CONFIG_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    python = os.path.join(_bare_venv(tmp_path / "capped"), "bin", "python")
    assert "torch<=2.14.1" in lanes._pip_constraint(python)  # the cap is seen, as on a fresh machine

    overrode = lanes.clear_machine_constraint("newest", str(tmp_path / "capped"))
    assert overrode and "torch<=2.14.1, torchvision<=0.29.1" in overrode
    assert lanes._pip_constraint(python) == ""
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "overrides the machine-wide pip constraint" in said

    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "nothing"))
    assert lanes.clear_machine_constraint("newest", _bare_venv(tmp_path / "uncapped")) is None
    assert not (tmp_path / "uncapped" / "pip.conf").exists()

    monkeypatch.setenv("PIP_CONSTRAINT", str(cap / "constraints.txt"))
    import pytest

    with pytest.raises(RuntimeError, match="PIP_CONSTRAINT"):
        lanes.clear_machine_constraint("newest", _bare_venv(tmp_path / "by-variable"))
