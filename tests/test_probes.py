"""Probed assumptions (NOTE [Probed assumptions] in ddp_patches/probes.py): every assumption holds on the torch under
test; where one is broken on purpose -- an internal renamed inside torch's own code, as torch 2.14 renamed the
non-reentrant generator -- that one patch steps aside with one WARNING naming the torch version and the
assumption, the other patches still act, and 2-rank DDP training still matches the single-process gradients."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Iterator

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import ddp_patches
from ddp_patches import checkpointing, probes, versions
from ddp_patches.rescue import join, reducer, teardown
from ddp_patches.offload import offloader as offload
from ddp_patches.offload import probes as offload_probes

needs_offload = pytest.mark.skipif(versions.offload_unsupported_reason() is not None,
                                   reason=str(versions.offload_unsupported_reason()))


@contextlib.contextmanager
def renamed_inside_torch(name: str) -> Iterator[None]:
    """Make torch.utils.checkpoint's own functions look up ``name`` under a new name, as a torch release that
    renames an internal would: the code objects are edited in place, so references bound before (``from
    torch.utils.checkpoint import checkpoint``) see it too. Restored on exit."""
    module = vars(torch_checkpoint)
    new = name + "_renamed_by_a_newer_torch"
    callers = [inspect.unwrap(torch_checkpoint.checkpoint)]
    if callable(module.get("_checkpoint_impl")):  # torch >= 2.14: checkpoint() delegates to it
        callers.append(module["_checkpoint_impl"])
    edited = [(f, f.__code__) for f in callers if name in f.__code__.co_names]
    assert edited, f"no function of torch.utils.checkpoint looks up {name}"
    module[new] = module[name]
    for f, code in edited:
        f.__code__ = code.replace(co_names=tuple(new if n == name else n for n in code.co_names))
    try:
        yield
    finally:
        for f, code in edited:
            f.__code__ = code
        del module[new]


def _probe_lines(records) -> list[str]:
    return [r.getMessage() for r in records if "steps aside: it assumes" in r.getMessage()]


# -- single process ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", [checkpointing, pytest.param(offload_probes, marks=needs_offload), reducer, join,
                                    teardown])
def test_every_assumption_holds_on_this_torch(module):
    assert probes._first_failure(module.ASSUMPTIONS) is None


@pytest.mark.slow
@pytest.mark.parametrize("where", ["a user's module body", "the end of torch's import", "an import hook's find_spec"])
def test_apply_inside_an_import_does_not_hang(tmp_path, where):
    """A probe thread waited for the module lock of an import the caller was still executing, and the caller
    waited for the thread: every process ddp-patches-run started hung (NOTE [No probe thread inside an import])."""
    import subprocess
    import sys

    from tests.harness import ROOT

    (tmp_path / "users_module.py").write_text("import torch, ddp_patches\nddp_patches.apply(offload=False)\n")
    hook = ("import importlib.abc, sys, torch\n"  # applies at the script's first import of colorsys (import lock held)
            "class ApplyFirst(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'colorsys':\n"
            "            sys.meta_path.remove(self); import ddp_patches; from ddp_patches import versions\n"
            "            ddp_patches.apply(offload=versions.offload_unsupported_reason() is None)\n"
            "sys.meta_path.insert(0, ApplyFirst())\n"
            "import colorsys, ddp_patches\n")
    code = ("import users_module, ddp_patches\n" if where == "a user's module body" else hook
            if where == "an import hook's find_spec" else
            "import importlib.abc, importlib.util, sys\n"
            "class AtTorch(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name != 'torch': return None\n"
            "        sys.meta_path.remove(self)\n"
            "        spec = importlib.util.find_spec('torch'); run = spec.loader.exec_module\n"
            "        def exec_module(module):\n"
            "            run(module); import ddp_patches; ddp_patches.apply(offload=False)\n"
            "        spec.loader.exec_module = exec_module\n"
            "        return spec\n"
            "sys.meta_path.insert(0, AtTorch())\n"
            "import torch, ddp_patches\n")
    code += "print('APPLIED', ddp_patches.is_applied(), sorted(set(ddp_patches.probes._results.values())))\n"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DDP_PATCHES_")},
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "APPLIED True [None]" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_another_threads_import_leaves_the_probes_on_their_own_thread(tmp_path, monkeypatch):
    """Only the calling thread's imports send the checks onto it (NOTE [No probe thread inside an import]): with
    another thread inside a module body, apply() under a FakeTensorMode still probes on a fresh thread."""
    import sys
    import threading
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode

    gate = types.ModuleType("ddp_patches_test_gate")
    gate.entered, gate.leave = threading.Event(), threading.Event()
    monkeypatch.setitem(sys.modules, gate.__name__, gate)
    (tmp_path / "slow_plugin.py").write_text(f"import {gate.__name__} as g\ng.entered.set()\ng.leave.wait(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importer = threading.Thread(target=__import__, args=("slow_plugin",))
    importer.start()
    try:
        assert gate.entered.wait(30)
        with FakeTensorMode():
            ddp_patches.apply()
        results = dict(probes._results)
    finally:
        gate.leave.set()
        importer.join()
        ddp_patches.revert()
        sys.modules.pop("slow_plugin", None)
    assert set(results.values()) == {None}, results


@needs_offload
def test_apply_probes_once_and_revert_forgets():
    ddp_patches.apply(offload=True)
    assert probes._results == {"checkpointing": None, "reducer": None, "no_sync": None, "teardown": None,
                               "offload": None}
    ddp_patches.revert()
    assert probes._results == {}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@needs_offload
@pytest.mark.parametrize("context", ["inference_mode", "no_grad", "meta-device", "autocast", "float64-default",
                                     "float16-default", "save_on_cpu", "hooks-disabled", "fake-tensor-mode"])
def test_the_callers_context_does_not_fail_a_probe(caplog, context):
    """apply() under inference_mode, inside ``with torch.device("meta")`` (a model built on the meta device), inside
    the user's own saved-tensor hooks or a FakeTensorMode made behaviour probes fail and turned those patches off
    for the whole process (NOTE [Probes test torch, not the caller's context])."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    enter = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad,
             "meta-device": lambda: torch.device("meta"), "autocast": lambda: torch.autocast("cpu", torch.bfloat16),
             "float64-default": lambda: _default_dtype(torch.float64),
             "float16-default": lambda: _default_dtype(torch.float16),
             "save_on_cpu": torch.autograd.graph.save_on_cpu,
             "hooks-disabled": lambda: torch.autograd.graph.disable_saved_tensors_hooks("the user's reason"),
             "fake-tensor-mode": FakeTensorMode}[context]
    with caplog.at_level(logging.WARNING, logger="ddp_patches"):
        with enter():
            ddp_patches.apply(offload=True)
        results = dict(probes._results)
        ddp_patches.revert()
    assert _probe_lines(caplog.records) == [] and set(results.values()) == {None}, results
    assert torch.get_default_dtype() == torch.float32


def test_offload_follows_the_generator_checkpoint_calls():
    report = ddp_patches.apply(offload=True)
    name = offload_probes.generator_name()
    assert f"torch.utils.checkpoint.{name}" in report.installed
    assert getattr(vars(torch_checkpoint)[name], "__ddp_patches__", False)
    calls_it = [n for n in offload_probes.GENERATOR_NAMES if n in _names_checkpoint_looks_up()]
    assert calls_it[:1] == [name]


def _names_checkpoint_looks_up() -> set[str]:
    names = set(inspect.unwrap(torch_checkpoint.checkpoint).__code__.co_names)
    impl = vars(torch_checkpoint).get("_checkpoint_impl")
    return names | (set(impl.__code__.co_names) if impl is not None else set())


@pytest.mark.parametrize("internal,patch,assumption", [
    pytest.param("generator", "offload", "generator-global", marks=needs_offload),
    ("CheckpointFunction", "checkpointing", "reentrant-call-site"),
])
def test_a_renamed_internal_makes_one_patch_step_aside(caplog, internal, patch, assumption):
    name = offload_probes.generator_name() if internal == "generator" else internal
    with renamed_inside_torch(name), caplog.at_level(logging.WARNING, logger="ddp_patches"):
        report = ddp_patches.apply(offload=True)
        lines = _probe_lines(caplog.records)
        assert probes.failed(patch) == assumption
        assert [probes.failed(p) for p in ("checkpointing", "reducer", "no_sync", "teardown", "offload")
                if p != patch] == [None] * 4
        ddp_patches.revert()
    assert len(lines) == 1, lines
    assert f"torch {torch.__version__}" in lines[0] and f"the {patch} patch steps aside" in lines[0]
    assert f"[{assumption}]" in lines[0] and "please report" in lines[0]
    stepped = offload.TARGET.rsplit(".", 1)[0] if patch == "offload" else checkpointing.TARGET
    assert not [n for n in report.installed if n.startswith(stepped) and (patch != "offload" or "without" in n)]
    assert "DistributedDataParallel.__init__" in report.installed  # the others are installed
    assert any(f"{patch} stepped aside" in note for note in report.notes)


# -- 2 ranks: the others still act, gradients still match -------------------------------------------------------------
def stepped_aside_case(internal: str) -> dict:
    """Per rank, with one internal renamed: apply(offload=True), then train a 4-block checkpointed stack under DDP
    against the full-batch replica, with offload forced through its CPU path."""
    from ddp_patches.verify.cpu_offload import cpu_path_offloader
    from ddp_patches.verify.parity import run_parity
    from ddp_patches.verify.raw_models import CheckpointStack, raw_batch

    name = offload_probes.generator_name() if internal == "generator" else internal
    # offload steps aside: the reentrant stack with find_unused=True fails unpatched ("marked as ready twice"),
    # so parity proves the swap still acts. The swap steps aside: a non-reentrant stack, where offload must move.
    reentrant = internal == "generator"
    ddp_kwargs = {"find_unused_parameters": True} if reentrant else {}
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("ddp_patches").addHandler(handler)
    try:
        with renamed_inside_torch(name):
            report = ddp_patches.apply(offload=True)
            forced = cpu_path_offloader()
            with offload.use_offloader(forced):
                parity = run_parity(lambda: CheckpointStack(use_reentrant=reentrant).double(), raw_batch, torch.cat,
                                    lambda m, x: m(x[:, :-1]).pow(2).mean(), ddp_kwargs=ddp_kwargs, accum=2)
            ddp_patches.revert()
    finally:
        logging.getLogger("ddp_patches").removeHandler(handler)
    return {"parity": parity.as_dict(), "installed": report.installed, "probe_lines": _probe_lines_text(records),
            "swap_lines": [r for r in records if "use_reentrant=True -> False" in r],
            "offloaded": forced.stats.offloaded_tensors, "rank": torch.distributed.get_rank()}


def _probe_lines_text(messages: list[str]) -> list[str]:
    return [m for m in messages if "steps aside: it assumes" in m]


@needs_offload
def test_offload_steps_aside_and_the_swap_still_acts(pool):
    for r in pool.run(stepped_aside_case, internal="generator"):
        assert r["parity"]["max_rel_error"] < 1e-12 and r["parity"]["ranks_in_sync"], r
        assert r["offloaded"] == 0  # offload stepped aside: nothing moved
        if r["rank"] == 0:
            assert len(r["probe_lines"]) == 1 and "[generator-global]" in r["probe_lines"][0]
        else:
            assert r["probe_lines"] == []  # one line, on rank 0
        assert len(r["swap_lines"]) == (1 if r["rank"] == 0 else 0)  # the swap acted
        assert "torch.utils.checkpoint.CheckpointFunction" in r["installed"]


@needs_offload
def test_swap_steps_aside_and_offload_still_acts(pool):
    for r in pool.run(stepped_aside_case, internal="CheckpointFunction"):
        assert r["parity"]["max_rel_error"] < 1e-12 and r["parity"]["ranks_in_sync"], r
        assert r["offloaded"] > 0  # offload acted on the non-reentrant checkpoints
        assert r["swap_lines"] == []
        if r["rank"] == 0:
            assert len(r["probe_lines"]) == 1 and "[reentrant-call-site]" in r["probe_lines"][0]
        else:
            assert r["probe_lines"] == []
        assert "torch.utils.checkpoint.CheckpointFunction" not in r["installed"]
