"""``ddp-patches-run`` and processes of another interpreter.

The runner puts ``ddp_patches/_bootstrap`` first on PYTHONPATH, and every Python process the command starts
inherits it -- also one of another interpreter (the system's ``python3``, a tool's venv) that has no ddp_patches.
There the bootstrap must be inert and silent, and must still run the ``sitecustomize`` it shadows (Debian ships
one), with the standard library alone.

A real second interpreter: a venv made with ``--without-pip`` and without system site-packages, so neither
ddp_patches nor torch can be imported in it (checked). The "system" sitecustomize is a fake one further on the
path that records which interpreter ran it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddp_patches import autoapply

SHADOWED = textwrap.dedent("""
    import os, sys
    with open(os.environ["MARKER"], "a") as f:
        f.write(sys.prefix + "\\n")
""")

PARENT = textwrap.dedent("""
    import os, subprocess, sys
    # This interpreter has ddp_patches: the start-up hook is armed (it waits for torch) and the shadowed
    # sitecustomize ran too.
    armed = any(type(f).__name__ == "_ApplyAfterTorchImport" for f in sys.meta_path)
    print("PARENT", armed, flush=True)
    child = subprocess.run([sys.argv[1], "-c", "import sys; print('CHILD', sys.prefix)"], capture_output=True,
                           text=True, cwd=sys.argv[2])
    sys.stdout.write(child.stdout)
    sys.stderr.write(child.stderr)
    sys.exit(child.returncode)
""")


@pytest.fixture(scope="module")
def other_python(tmp_path_factory) -> str:
    """An interpreter without ddp_patches and without torch (a venv without system site-packages)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    python = str(venv / "bin" / "python")
    probe = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('ddp_patches') is None, "
                            "u.find_spec('torch') is None)"], capture_output=True, text=True, cwd=str(venv),
                           env={"PATH": os.environ.get("PATH", "")})
    assert probe.stdout.split() == ["True", "True"], probe.stdout + probe.stderr
    return python


def _environment(tmp_path: Path, **extra: str) -> dict:
    """What ``ddp-patches-run`` gives its command: the bootstrap first on PYTHONPATH, DDP_PATCHES_APPLY=1; after
    it, a directory with the sitecustomize it shadows. The repository itself is not on the path: a child only
    finds ddp_patches if its interpreter has it installed."""
    shadowed = tmp_path / "system_site"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text(SHADOWED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_PATCHES_") and k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MARKER=str(tmp_path / "marker"), PYTHONPATH=str(shadowed), **extra)
    return autoapply.environment({}, None, env)


def _ran_shadowed(tmp_path: Path) -> list[str]:
    marker = tmp_path / "marker"
    return marker.read_text().split() if marker.exists() else []


def test_a_child_of_another_interpreter_is_silent_and_runs_the_shadowed_sitecustomize(tmp_path, other_python):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = _environment(tmp_path)
    out = subprocess.run([sys.executable, str(script), other_python, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "Error in sitecustomize" not in out.stderr and "ddp_patches" not in out.stderr, out.stderr
    child_prefix = str(Path(other_python).parent.parent)
    assert out.stdout.splitlines() == ["PARENT True", f"CHILD {child_prefix}"], out.stdout
    # the shadowed sitecustomize ran in both: the parent (ddp_patches importable) and the child (not)
    assert _ran_shadowed(tmp_path) == [sys.prefix, child_prefix], _ran_shadowed(tmp_path)


def test_the_runner_launching_another_interpreter_directly(tmp_path, other_python):
    """``ddp-patches-run /usr/bin/python3 tool.py``: the command itself has no ddp_patches."""
    env = _environment(tmp_path)
    env["PYTHONPATH"] = env["PYTHONPATH"].split(os.pathsep, 1)[1]  # the runner puts the bootstrap first again
    out = subprocess.run([sys.executable, "-m", "ddp_patches.autoapply", other_python, "-c",
                          "import sys; print('TOOL', 'sitecustomize' in sys.modules)"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr
    assert out.stdout.split() == ["TOOL", "True"]
    # the runner's own interpreter (before it execs the command) and the tool's both ran it
    assert _ran_shadowed(tmp_path) == [sys.prefix, str(Path(other_python).parent.parent)], _ran_shadowed(tmp_path)


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no system python3")
def test_the_system_python3_keeps_its_own_sitecustomize():
    """Debian's /usr/lib/python3.X/sitecustomize.py (apport's hook) still runs under the bootstrap."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_PATCHES_") and k != "PYTHONPATH"}
    if subprocess.run(["/usr/bin/python3", "-c", "import ddp_patches"], capture_output=True, cwd="/",
                      env=env).returncode == 0:
        pytest.skip("this system python3 has ddp_patches installed")
    code = "import sys; m = sys.modules.get('sitecustomize'); print(getattr(m, '__file__', None))"
    plain = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=60, env=env,
                           cwd="/")
    out = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=60,
                         env=autoapply.environment({}, None, env), cwd="/")
    assert out.stderr == "", out.stderr
    assert out.stdout == plain.stdout, (out.stdout, plain.stdout)  # the system's own sitecustomize, or none
