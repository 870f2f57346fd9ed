"""apply()/revert()/patched(): identity restore, idempotence, argument and version errors, no import side effects."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_patches
from ddp_patches import versions
from ddp_patches.offload import probes as offload_probes

TARGETS = [
    (torch_checkpoint, "CheckpointFunction"),
    (torch_checkpoint, offload_probes.generator_name()),  # the one checkpoint() calls on this torch
    (DDP, "__init__"),
    (DDP, "no_sync"),
]


def _raw():
    return [vars(owner)[name] for owner, name in TARGETS]


def test_revert_restores_originals_by_identity():
    before = _raw()
    ddp_patches.apply(offload=True)
    during = _raw()
    assert all(a is not b for a, b in zip(before, during))
    for replacement, original in zip(during, before):
        assert replacement.__ddp_patches__ is True and replacement.__wrapped__ is original
    ddp_patches.revert()
    assert all(a is b for a, b in zip(before, _raw()))
    assert ddp_patches.revert() == []  # nothing left to do


def test_apply_twice_is_apply_once():
    first = ddp_patches.apply()
    after_first = _raw()
    assert ddp_patches.apply() is first
    assert all(a is b for a, b in zip(after_first, _raw()))


def test_apply_with_other_options_reapplies():
    ddp_patches.apply()
    report = ddp_patches.apply(reducer=False, offload=False, on_unsynced="off", replica_check_every=0)
    # (and DeepSpeedEngine.__init__ where deepspeed is already imported: ddp_patches/engines/zero.py)
    assert [n for n in report.installed if not n.startswith("deepspeed.")] == ["torch.utils.checkpoint.CheckpointFunction"]
    assert vars(DDP)["__init__"].__qualname__ == "DistributedDataParallel.__init__"
    assert not hasattr(vars(DDP)["__init__"], "__ddp_patches__")


def test_patched_context_reverts_on_error():
    before = _raw()
    with pytest.raises(KeyError):
        with ddp_patches.patched():
            raise KeyError("boom")
    assert all(a is b for a, b in zip(before, _raw()))


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="offlaod"):
        ddp_patches.apply(offlaod=True)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"offload": "yes"}, ValueError, "expects 'auto', True or False"),
    ({"checkpointing": 1}, TypeError, "expects True or False"),
    ({"tiled_mlp_shard_tokens": 0}, ValueError, "None \\(automatic\\) or a number of tokens per shard >= 1, got 0"),
    ({"chunked_loss": "yes"}, TypeError, "chunked_loss=...\\) expects True or False, got 'yes'"),
    ({"offload_min_bytes": -1}, ValueError, "a number of bytes >= 0, got -1"),
    ({"offload_max_pinned_bytes": "1G"}, ValueError, "None \\(automatic\\) or a number of bytes"),
])
def test_bad_values_say_what_was_expected(kwargs, error, match):
    with pytest.raises(error, match=match):
        ddp_patches.apply(**kwargs)
    assert not ddp_patches.is_applied()


def test_shard_tokens_without_tiled_mlp_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="ddp_patches"):
        report = ddp_patches.apply(tiled_mlp_shard_tokens=64)
    assert not [name for name in report.installed if "MLP" in name]
    assert "ignored because tiled_mlp=False" in caplog.text


def test_offload_true_on_a_cpu_host_says_why_it_is_inert(caplog):
    with caplog.at_level(logging.WARNING, logger="ddp_patches"):
        report = ddp_patches.apply(offload=True)
    assert f"torch.utils.checkpoint.{offload_probes.generator_name()}" in report.installed
    assert "no CUDA device" in caplog.text and "inert" in caplog.text


def test_offload_is_opt_in_and_auto_means_off_with_one_warning(caplog):
    from ddp_patches.offload import offloader as offload

    assert offload.target() not in ddp_patches.apply().installed  # the default installs no offload
    ddp_patches.revert()
    with caplog.at_level(logging.WARNING, logger="ddp_patches"):
        report = ddp_patches.apply(offload="auto")
    assert offload.target() not in report.installed and report.options["offload"] is False
    lines = [r.getMessage() for r in caplog.records if "offload='auto' now means offload=False" in r.getMessage()]
    assert len(lines) == 1 and "opt-in" in lines[0]


def test_offload_false_installs_no_offload_patch():
    report = ddp_patches.apply(offload=False)
    assert not [name for name in report.installed if "without_reentrant" in name]


def test_unsupported_torch_version_is_named(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.1.0")
    with pytest.raises(ddp_patches.UnsupportedVersionError, match=r"torch 2\.1\.0 is older than .* 2\.4"):
        ddp_patches.apply()
    assert not ddp_patches.is_applied()


def test_unsupported_transformers_version_is_named():
    with pytest.raises(ddp_patches.UnsupportedVersionError, match=r"transformers 4\.30\.0 .* pip install"):
        versions.check({"torch": "2.13.0", "transformers": "4.30.0"})
    versions.check({"torch": "2.13.0", "transformers": None})  # not installed: nothing to check


def test_import_changes_nothing():
    code = (
        "import torch.utils.checkpoint as c; from torch.nn.parallel import DistributedDataParallel as D;"
        "names = ('CheckpointFunction', '_checkpoint_without_reentrant_generator');"
        "before = [vars(c)[n] for n in names] + [vars(D)['__init__'], vars(D)['no_sync']];"
        "import ddp_patches;"
        "after = [vars(c)[n] for n in names] + [vars(D)['__init__'], vars(D)['no_sync']];"
        "assert all(a is b for a, b in zip(before, after)); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_originals_are_not_stashed_on_torch():
    ddp_patches.apply()
    for owner in (torch_checkpoint, DDP, torch):
        assert not [k for k in vars(owner) if "ddp_patches" in k.lower() or "original" in k.lower()]


def test_nested_patched_restores_the_previous_options_exactly():
    outer = ddp_patches.apply(offload=False)
    with ddp_patches.patched(tiled_mlp=True) as inner:
        assert inner.options["tiled_mlp"] is True
    assert ddp_patches.is_applied()
    from ddp_patches import api

    assert api._state["report"].options == outer.options


def reapply_keeps_live_ddp_protected() -> bool:
    """apply() again with other options while a DDP exists; rank 1 never uses the branch."""
    from tests.test_reach import _Branchy, _flag_batch, _mse

    rank = torch.distributed.get_rank()
    make = _flag_batch(lambda r, it: r == 0)
    torch.manual_seed(0)
    ddp_patches.apply()
    ddp = DDP(_Branchy().double())
    for it in range(4):
        if it == 2:
            ddp_patches.apply(offload=False)  # other options, same process, the DDP alive
        _mse(ddp, make(rank, it, 0)).backward()
    ddp_patches.revert()
    return True


@pytest.mark.slow
def test_reapply_keeps_live_ddps_protected(pool):
    assert pool.run(reapply_keeps_live_ddp_protected) == [True, True]


def test_apply_in_a_launched_process_without_a_group_does_not_import_dynamo():
    """DataLoader workers inherit WORLD_SIZE and the runner applies in each: registering the compile notice there
    imported dynamo (about 1.5 s, as much as torch itself). It waits for the first distributed call instead."""
    import os

    code = "import sys, torch, ddp_patches; ddp_patches.apply(); print('torch._dynamo' in sys.modules)"
    env = dict(os.environ, WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "False", out.stderr


TORCH_ONLY_SCRIPT = """
import os, sys
for name in ("transformers", "peft", "trl", "accelerate"):  # a torch-only install: these cannot be imported
    sys.modules[name] = None
sys.path.insert(0, os.environ["ROOT"])
import torch, torch.distributed as dist, torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP
import ddp_patches
if sys.argv[1] == "patched":
    ddp_patches.apply()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
reference.load_state_dict(model.state_dict())
ddp = DDP(model)
opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
worst = 0.0
for step in range(3):
    batches = [torch.randn(3, 4, dtype=torch.double, generator=torch.Generator().manual_seed(100 * step + r))
               for r in range(world)]
    checkpointed = torch.utils.checkpoint.checkpoint(ddp, batches[rank], use_reentrant=False)
    checkpointed.pow(2).mean().backward()  # each rank its own data, through the checkpointing patch
    reference(torch.cat(batches)).pow(2).mean().backward()  # one process, the global batch
    worst = max(worst, max((p.grad - q.grad).abs().max().item() for p, q in zip(ddp.parameters(), reference.parameters())))
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
with open(os.path.join(os.environ["OUT"], f"{sys.argv[1]}-{rank}"), "w") as f:  # before the exit, which can abort
    f.write(repr(worst))                                                       # unpatched (the teardown bug)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_torch_only_process_trains_under_apply(tmp_path):
    """transformers, peft, trl and accelerate are optional (pyproject's [hf] extra): building and training a DDP
    under apply() must not need them (tiled_mlp.enabled() imported transformers on every DDP construction)."""
    from tests.external import aborted_only_at_exit, run_bounded, torchrun
    from tests.harness import ROOT

    script = tmp_path / "torch_only.py"
    script.write_text(TORCH_ONLY_SCRIPT)
    for mode in ("unpatched", "patched"):
        out = run_bounded(torchrun(str(script), mode, patched=False), timeout=120,
                          env={"ROOT": ROOT, "OUT": str(tmp_path)})
        worst = [float(f.read_text()) for f in sorted(tmp_path.glob(f"{mode}-*"))]
        if mode == "unpatched" and aborted_only_at_exit(out, work_done=bool(worst)):
            # torch's own exit-time abort, which the teardown patch removes (tests/external.py); a rank torchrun
            # stopped after its peer aborted may not have written its figure
            assert worst and max(worst) < 1e-12, (mode, worst)
            continue
        assert out.returncode == 0, out.stderr[-3000:]
        assert len(worst) == 2 and max(worst) < 1e-12, (mode, worst)


def test_tiled_mlp_without_transformers_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"apply\(tiled_mlp=True\) .* needs transformers .* leave tiled_mlp off"):
        ddp_patches.apply(tiled_mlp=True)
    assert not ddp_patches.is_applied()


# -- offload's prefetch depth and in-flight window -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["offload_prefetch_depth", "offload_max_in_flight"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_offload_depths_must_be_whole_numbers_of_at_least_one(name, value):
    with pytest.raises(ValueError, match=rf"apply\({name}=\.\.\.\) expects a whole number >= 1 .*got {value!r}; "
                                         r"leave it out for the default \(1\)"):
        ddp_patches.apply(offload=True, **{name: value})
    assert not ddp_patches.is_applied()


def test_offload_depths_reach_the_offloader_and_the_launcher():
    from ddp_patches import autoapply
    from ddp_patches.offload import offloader as offload

    report = ddp_patches.apply(offload=True, offload_prefetch_depth=3, offload_max_in_flight=2)
    off = offload.current()
    assert (off.prefetch_depth, off.max_in_flight) == (3, 2) and off.restorer.depth == 3
    assert report.options["offload_prefetch_depth"] == 3 and report.options["offload_max_in_flight"] == 2
    ddp_patches.revert()
    env = {"DDP_PATCHES_OFFLOAD_PREFETCH_DEPTH": "2", "DDP_PATCHES_OFFLOAD_MAX_IN_FLIGHT": "4"}
    assert autoapply.options_from_env(env) == {"offload_prefetch_depth": 2, "offload_max_in_flight": 4}
    with pytest.raises(ValueError, match="DDP_PATCHES_OFFLOAD_PREFETCH_DEPTH='0' is not valid: expected a number >= 1"):
        autoapply.options_from_env({"DDP_PATCHES_OFFLOAD_PREFETCH_DEPTH": "0"})


def test_revert_forgets_every_modules_state():
    """NOTE [Each module forgets its own state]: revert() clears what each module keeps (probe verdicts, once-only
    log keys, waiting callbacks, the engine seen) without api naming any of them."""
    from ddp_patches import distributed, engines, probes

    ddp_patches.apply(offload=True)
    distributed.log_rank0_once("test-forget", logging.DEBUG, "once")
    distributed.on_first_distributed(lambda: None)
    engines._last["engine"] = "ddp"
    offload_probes._found.setdefault("name", "probed")  # apply() probes nothing for offload on torch < 2.8
    assert probes._results and offload_probes._found and distributed._logged_once and distributed._on_first
    ddp_patches.revert()
    assert not (probes._results or offload_probes._found or distributed._logged_once or distributed._on_first)
    assert engines._last["engine"] is None


def _defer_the_runners_apply(monkeypatch) -> list[str]:
    """What ddp-patches-run does when torch is imported inside another import: stand-ins wait for the first use.
    The deferred apply() only records that it ran; returns that record."""
    from ddp_patches import autoapply

    calls: list[str] = []
    monkeypatch.setattr(autoapply, "_import_in_progress", lambda: True)
    monkeypatch.setattr(autoapply, "apply_from_env", lambda: calls.append("deferred"))
    autoapply.apply_after_torch_import()
    return calls


def test_a_deferred_apply_settles_first_and_revert_drops_it(monkeypatch):
    """NOTE [A deferred apply() settles first]: the runner's stand-ins are registry patches (marked, unwrappable);
    the script's own apply() runs the deferred one first and puts the originals back; revert() drops a deferral."""
    import torch.distributed as dist

    from ddp_patches import autoapply

    original = vars(dist)["init_process_group"]
    calls = _defer_the_runners_apply(monkeypatch)
    stand_in = vars(dist)["init_process_group"]
    assert stand_in.__ddp_patches__ is True and stand_in.__wrapped__ is original
    assert ddp_patches.revert() == []  # the stand-ins go, and are not reported as patches of an apply()
    assert vars(dist)["init_process_group"] is original and vars(DDP)["__init__"].__module__ == "torch.nn.parallel.distributed"
    ddp_patches.apply()
    assert calls == []  # the deferral went with revert()
    ddp_patches.revert()
    autoapply.apply_after_torch_import()
    ddp_patches.apply()
    assert calls == ["deferred"] and vars(dist)["init_process_group"] is original
    assert ddp_patches.is_applied()


def test_a_wrapper_around_a_stand_in_reaches_the_original(monkeypatch):
    """A library that wraps DDP.__init__ while the runner's apply() waits: the first call settles, and the stand-in,
    reached again through that wrapper, hands the call to the original instead of recursing."""
    original = vars(DDP)["__init__"]
    calls = _defer_the_runners_apply(monkeypatch)
    stand_in = vars(DDP)["__init__"]

    def wrapper(self, *args, **kwargs):
        return stand_in(self, *args, **kwargs)

    DDP.__init__ = wrapper
    try:
        with pytest.raises((ValueError, RuntimeError), match="process group"):  # no group here: DDP's own error
            DDP(torch.nn.Linear(2, 2))
        assert calls == ["deferred"]
    finally:
        DDP.__init__ = original

