"""Upstream suites as regression gates: accelerate's test_sync.py and PyTorch's DDP tests, unpatched vs patched.

Each runs unchanged in real processes; the patched runs go through ddp-patches-run, so every rank (torchrun's
and PyTorch's spawned test ranks alike) is patched the way a user would patch it.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.external import RUNNER, aborted_only_at_exit, run_bounded, torchrun

pytestmark = pytest.mark.e2e

UPSTREAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream")
TO_THE_END = os.path.join(UPSTREAM, "to_the_end.py")  # runs the script unchanged, then says it returned
# PyTorch's DDP tests that run on CPU/gloo (the rest need CUDA devices); all pass unpatched.
TORCH_CPU_DDP_TESTS = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_ddp_logging_data_cpu",  # failed when an earlier design forced find_unused_parameters
    "test_dump_DDP_relevant_env_vars",
]


def accelerate_script(name: str) -> str:
    import accelerate.test_utils.scripts as scripts

    return os.path.join(os.path.dirname(scripts.__file__), name)


@pytest.mark.slow
@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
@pytest.mark.parametrize("script", ["test_sync.py", "gpu-gated sections"])
def test_accelerate_test_sync(script, patched):
    sections = os.path.join(UPSTREAM, "accelerate_sync_sections.py")
    path = accelerate_script(script) if script == "test_sync.py" else sections
    # ACCELERATE_USE_CPU: without it every CPU rank silently trains alone (FACTS) and nothing is tested.
    out = run_bounded(torchrun(TO_THE_END, path, patched=patched), timeout=240, env={"ACCELERATE_USE_CPU": "true"})
    if not patched and aborted_only_at_exit(out, work_done="SCRIPT RETURNED on rank" in out.stdout):
        pass  # torch's exit-time race in the unpatched reference (tests/external.py); the patched run must exit 0
    else:
        assert out.returncode == 0, out.stderr[-4000:]
        assert out.stdout.count("SCRIPT RETURNED on rank") == 2, out.stdout[-2000:]
    assert "Test Distributed `no_sync` context manager with multiple forwards" in out.stdout or script != "test_sync.py"
    if patched:
        assert "DistributedDataParallel built with" in out.stderr  # the ranks really were patched


@pytest.mark.slow
@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_pytorch_ddp_tests_cpu_subset(tmp_path, patched):
    env = {"BACKEND": "gloo", "WORLD_SIZE": "2", "TEMP_DIR": str(tmp_path), "INIT_METHOD": f"file://{tmp_path}/init"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
           os.path.join(UPSTREAM, "torch_ddp_spawn.py"), "-k", " or ".join(TORCH_CPU_DDP_TESTS)]
    out = run_bounded(RUNNER + ["--log-level", "INFO"] + cmd if patched else cmd, timeout=400, env=env)
    assert f"{len(TORCH_CPU_DDP_TESTS)} passed" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
    if patched:
        assert "DistributedDataParallel built with" in out.stdout + out.stderr
