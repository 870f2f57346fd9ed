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
           "DDP_PATCHES_OFFLOAD_MIN_BYTES": "4096", "DDP_PATCHES_CHUNKED_LOSS": "true"}
    assert autoapply.options_from_env(env) == {"offload": False, "tiled_mlp": True, "tiled_mlp_shard_tokens": None,
                                               "offload_min_bytes": 4096, "chunked_loss": True}
    with pytest.raises(ValueError, match=r"DDP_PATCHES_OFFLOAD='maybe' is not valid: expected auto, true or false"):
        autoapply.options_from_env({"DDP_PATCHES_OFFLOAD": "maybe"})


def test_cli_rejects_bad_input_before_running_anything():
    bad = run([sys.executable, "-m", "ddp_patches.autoapply", "--tiled-mlp", "sometimes", "true"])
    assert bad.returncode == 2 and "--tiled-mlp='sometimes' is not valid: expected true or false" in bad.stderr
    missing = run([sys.executable, "-m", "ddp_patches.autoapply"])
    assert missing.returncode == 2 and "no command given" in missing.stderr


@pytest.mark.parametrize("args,expected", [
    (["--offload-min-bytes", "lots", "true"], "--offload-min-bytes='lots' is not valid: expected a whole number >= 0"),
    (["--replica-check-every", "1.5", "true"], "--replica-check-every='1.5' is not valid: expected a whole number"),
    (["--offload-prefetch-depth", "x", "true"], "--offload-prefetch-depth='x' is not valid: expected a whole number"),
    (["--tiled-mlp-shard-tokens", "0", "true"], "--tiled-mlp-shard-tokens='0' is not valid: expected a number >= 1"),
    ([ROOT], "expected a command to run (e.g. torchrun); found a directory"),
    ([os.path.join(ROOT, "pyproject.toml")], "found a file that is not executable"),
], ids=["bytes-word", "every-fraction", "depth-word", "shard-zero", "directory", "not-executable"])
def test_cli_answers_bad_values_in_one_line(args, expected):
    """A value that is not a whole number says what was expected (not int()'s "invalid literal"), and a command
    that is a directory or a plain file says which, in one error line with argparse's exit status."""
    out = run([sys.executable, "-m", "ddp_patches.autoapply", *args])
    errors = [line for line in out.stderr.splitlines() if ": error: " in line]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(errors) == 1 and expected in errors[0] and errors[0] == out.stderr.strip().splitlines()[-1], out.stderr


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


@pytest.mark.slow
def test_print_env_switches_every_process_of_a_launch(tmp_path):
    """NOTE [One switch for a whole launch]: the variables exported once (as an sbatch script would) reach every
    rank a launcher starts with no command prefix; printed twice, the path is not doubled; dotenv is KEY=VALUE."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cli = f"{sys.executable} -m ddp_patches.autoapply"
    shell = (f'eval "$({cli} --print-env --offload false)"; eval "$({cli} --print-env --offload false)"; '
             f'echo "PATHS $PYTHONPATH"; torchrun --nproc_per_node=2 --master_port={_free_port()} {script}')
    out = run(["bash", "-c", shell], env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"PATHS {autoapply.BOOTSTRAP_DIR}{os.pathsep}{tmp_path}\n" in out.stdout, out.stdout
    assert [line.split()[1] for line in probes(out.stdout)] == ["0", "1"], (out.stdout, out.stderr[-2000:])
    assert all("(False, False) True" in line and "'offload': False" in line for line in probes(out.stdout)), out.stdout
    dotenv = run([sys.executable, "-m", "ddp_patches.autoapply", "--print-env", "dotenv"],
                 env={"PYTHONPATH": ""}).stdout.splitlines()
    assert dotenv == [f"PYTHONPATH={autoapply.BOOTSTRAP_DIR}", "DDP_PATCHES_APPLY=1"], dotenv
    # after the eval, as in docs/integrations.md: the file for other nodes holds everything, not only what changed here
    shell = f'eval "$({cli} --print-env --offload false)"; {cli} --print-env dotenv'
    again = run(["bash", "-c", shell], env={"PYTHONPATH": ""}).stdout.splitlines()
    assert again == [f"PYTHONPATH={autoapply.BOOTSTRAP_DIR}", "DDP_PATCHES_APPLY=1", "DDP_PATCHES_OFFLOAD=false"], again
    both = run([sys.executable, "-m", "ddp_patches.autoapply", "--print-env", "sh", "torchrun", "x.py"])
    assert both.returncode == 2 and "runs nothing; found a command too: 'torchrun'" in both.stderr


def test_console_script_is_installed():
    import shutil

    path = shutil.which("ddp-patches-run")
    assert path, "pip install -e . installs the ddp-patches-run console script (pyproject [project.scripts])"
    out = run([path, "--help"])
    assert out.returncode == 0 and "every Python process it starts" in out.stdout


# -- the runner meets imports and bad input -------------------------------------------------------------------------------------
def test_the_readme_quick_start_under_the_runner():
    """The script itself does ``import ddp_patches; ddp_patches.apply()`` (api imports torch, whose import
    hook must not re-enter the half-initialised api)."""
    code = ("import ddp_patches; report = ddp_patches.apply(offload=True); import torch; "
            "print('PROBE', ddp_patches.is_applied(), report.options['offload'])")
    out = run([sys.executable, "-m", "ddp_patches.autoapply", "--offload", "false", sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr[-2000:]
    assert probes(out.stdout) == ["PROBE True True"]  # the script's own apply() has the last word


@pytest.mark.slow
@pytest.mark.parametrize("first", ["from transformers import PretrainedConfig", "import trl", "import accelerate"])
def test_libraries_imported_before_torch_with_tiled_mlp(first, tmp_path):
    """transformers (or trl, accelerate) imports torch inside its own import chain; apply() must not import
    transformers there. It runs at first use instead: here the process group's creation."""
    code = (f"{first}\nimport torch, torch.distributed as dist, ddp_patches\n"
            "before = ddp_patches.is_applied()\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path}/pg', rank=0, world_size=1)\n"
            "print('PROBE', before, ddp_patches.is_applied(), ddp_patches.api._state['report'].options['tiled_mlp'])\n"
            "dist.destroy_process_group()")
    out = run([sys.executable, "-m", "ddp_patches.autoapply", "--tiled-mlp", "true", sys.executable, "-c", code],
              timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = probes(out.stdout)
    assert line.endswith("True True"), line


@pytest.mark.parametrize("variable,value", [("DDP_PATCHES_OFFLOAD", "maybe"), ("DDP_PATCHES_LOG_LEVEL", "verbose")])
def test_bad_environment_options_fail_before_launch(variable, value):
    """A bad value already in the environment fails in the runner, naming the variable, and runs nothing."""
    code = "print('PROBE ran')"
    out = run([sys.executable, "-m", "ddp_patches.autoapply", sys.executable, "-c", code], env={variable: value})
    assert out.returncode == 2 and variable in out.stderr and probes(out.stdout) == [], (out.stdout, out.stderr)
    # And where the start-up hook meets it without the runner's check (set by hand), the process stops too.
    hand = run([sys.executable, "-c", "import torch; " + code],
               env={"PYTHONPATH": os.pathsep.join([autoapply.BOOTSTRAP_DIR, os.environ.get("PYTHONPATH", ROOT)]),
                    autoapply.ENABLE: "1", variable: value})
    assert hand.returncode != 0 and variable in hand.stderr and probes(hand.stdout) == [], (hand.stdout, hand.stderr)


def test_the_import_check_does_not_run_a_lazily_loaded_module(tmp_path, monkeypatch):
    """Reading a lazily loaded module's ``__spec__`` (importlib.util.LazyLoader, the lazy_loader package) runs its
    body; a body that raises made the runner's hook fail where torch alone was fine."""
    import importlib.util

    (tmp_path / "lazy_plugin.py").write_text("raise ImportError('an optional dependency is missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.find_spec("lazy_plugin")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lazy_plugin", module)
    spec.loader.exec_module(module)
    assert autoapply._import_in_progress() is False


def test_a_misspelt_variable_is_named_once_per_launch():
    """An option variable spelt wrong (``DDP_PATCHES_TILED_MPL=1``) used to be ignored without a word: the run went
    on untiled. The launch's first process names it, with the nearest option; the processes it starts (ranks,
    DataLoader workers) and other ranks say nothing more, nor do the project's own variables; nothing stops."""
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import torch'], check=True); "
    code = child + "import torch; print('PROBE ran')"
    env = {"PYTHONPATH": os.pathsep.join([autoapply.BOOTSTRAP_DIR, os.environ.get("PYTHONPATH", ROOT)]),
           autoapply.ENABLE: "1", "DDP_PATCHES_TILED_MPL": "1", "DDP_PATCHES_DEVICE": "cpu",
           "DDP_PATCHES_TEST_RUN": "1"}
    runs = {name: run([sys.executable, "-c", code], env={**env, **extra}) for name, extra in
            (("rank0", {"RANK": "0"}), ("rank1", {"RANK": "1"}), ("no rank", {}), ("slurm rank 1", {"SLURM_PROCID": "1"}),
             ("quiet", {"RANK": "0", autoapply.LOG_LEVEL: "ERROR"}))}
    for name, out in runs.items():
        assert out.returncode == 0 and probes(out.stdout) == ["PROBE ran"], (name, out.stderr)
        warned = [line for line in out.stderr.splitlines() if "DDP_PATCHES_" in line]
        if name in ("rank0", "no rank"):  # once, though two processes started with it
            assert len(warned) == 1 and "DDP_PATCHES_TILED_MPL" in warned[0], (name, out.stderr)
            assert "did you mean DDP_PATCHES_TILED_MLP?" in warned[0], out.stderr
        else:
            assert warned == [], (name, out.stderr)
