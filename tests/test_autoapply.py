"""ddp-patches-run: apply() in every Python process a command starts, without editing a script."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

from ddp_patches import autoapply
from tests.harness import ROOT, _free_port

PROBE = textwrap.dedent("""
    import importlib.util, os, sys
    before = "torch" in sys.modules, "ddp_patches.api" in sys.modules
    importlib.util.find_spec("torch")  # transformers' availability check must not use up the hook
    import torch, ddp_patches
    print("PROBE", os.environ.get("RANK", "-"), before, ddp_patches.is_applied(),
          ddp_patches.api._state["report"].options if ddp_patches.is_applied() else None, flush=True)
""")


def run(args: list[str], env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDP_PATCHES_")}
    base.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, **(env or {}))
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=base, cwd=ROOT)


def probes(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith("PROBE"))


def test_options_cover_apply_exactly():
    import ddp_patches

    assert set(autoapply.OPTIONS) == set(inspect.signature(ddp_patches.apply).parameters)


def test_options_from_env_parse_and_name_a_bad_variable():
    env = {"DDP_PATCHES_OFFLOAD": "false", "DDP_PATCHES_TILED_MLP": "1", "DDP_PATCHES_TILED_MLP_SHARD_TOKENS": "auto",
           "DDP_PATCHES_OFFLOAD_MIN_BYTES": "4096"}
    assert autoapply.options_from_env(env) == {"offload": False, "tiled_mlp": True, "tiled_mlp_shard_tokens": None,
                                               "offload_min_bytes": 4096}
    with pytest.raises(ValueError, match=r"DDP_PATCHES_OFFLOAD='maybe' is not valid: expected auto, true or false"):
        autoapply.options_from_env({"DDP_PATCHES_OFFLOAD": "maybe"})


def test_cli_rejects_bad_input_before_running_anything():
    bad = run([sys.executable, "-m", "ddp_patches.autoapply", "--tiled-mlp", "sometimes", "true"])
    assert bad.returncode == 2 and "--tiled-mlp='sometimes' is not valid: expected true or false" in bad.stderr
    missing = run([sys.executable, "-m", "ddp_patches.autoapply"])
    assert missing.returncode == 2 and "no command given" in missing.stderr


def test_applies_after_torch_is_imported_with_the_options():
    out = run([sys.executable, "-m", "ddp_patches.autoapply", "--offload", "false", "--log-level", "INFO",
               sys.executable, "-c", PROBE])
    assert out.returncode == 0, out.stderr
    (line,) = probes(out.stdout)
    assert "(False, False) True" in line  # nothing imported before the script; applied once torch was
    assert "'offload': False" in line
    assert "ddp_patches installed" in out.stderr  # --log-level shows the library's INFO lines


def test_without_the_runner_nothing_is_applied():
    out = run([sys.executable, "-c", PROBE], env={"PYTHONPATH": autoapply.BOOTSTRAP_DIR})
    assert probes(out.stdout) == ["PROBE - (False, False) False None"]  # DDP_PATCHES_APPLY unset: inert


def test_a_users_own_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    code = ("import os, torch, ddp_patches; "
            "print('PROBE', os.environ.get('USER_SITECUSTOMIZE'), ddp_patches.is_applied())")
    out = run([sys.executable, "-m", "ddp_patches.autoapply", sys.executable, "-c", code],
              env={"PYTHONPATH": str(tmp_path)})
    assert probes(out.stdout) == ["PROBE ran True"], out.stderr


def test_every_torchrun_rank_is_patched(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = run([sys.executable, "-m", "ddp_patches.autoapply", "torchrun", "--nproc_per_node=2",
               f"--master_port={_free_port()}", str(script)])
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line.split()[1] for line in probes(out.stdout)] == ["0", "1"]
    assert all("(False, False) True" in line for line in probes(out.stdout))


def test_console_script_is_installed():
    import shutil

    path = shutil.which("ddp-patches-run")
    assert path, "pip install -e . installs the ddp-patches-run console script (pyproject [project.scripts])"
    out = run([path, "--help"])
    assert out.returncode == 0 and "every Python process it starts" in out.stdout
