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

TARGETS = [
    (torch_checkpoint, "CheckpointFunction"),
    (torch_checkpoint, "_checkpoint_without_reentrant_generator"),
    (DDP, "__init__"),
    (DDP, "no_sync"),
]


def _raw():
    return [vars(owner)[name] for owner, name in TARGETS]


def test_revert_restores_originals_by_identity():
    before = _raw()
    ddp_patches.apply()
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
    report = ddp_patches.apply(reducer=False, offload=False)
    assert report.installed == ("torch.utils.checkpoint.CheckpointFunction",)
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
    ({"tiled_mlp_shard_tokens": 0}, ValueError, "positive int"),
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
    assert "torch.utils.checkpoint._checkpoint_without_reentrant_generator" in report.installed
    assert "no CUDA device" in caplog.text and "inert" in caplog.text


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
