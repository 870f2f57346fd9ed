"""The doctor: each risky setting is named with the failure it causes and the fix; clean setups have none."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ddp_patches
from ddp_patches.doctor import diagnose


def training_args(tmp_path, **kwargs):
    from transformers import TrainingArguments

    kwargs.setdefault("use_cpu", True)
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)


@pytest.fixture(scope="module")
def lora_llm():
    from ddp_patches.verify.hf_models import build_lora_model

    return build_lora_model("llama", {"use_reentrant": True}, dtype=torch.float32)


@pytest.fixture(scope="module")
def vision_lora_vlm():
    from ddp_patches.verify.vlm_models import build_vlm

    return build_vlm("qwen2_vl", None, lora_on_vision=True)


def test_reentrant_with_trainer_default_find_unused_is_an_error(tmp_path, lora_llm):
    d = diagnose(lora_llm, training_args(tmp_path, gradient_checkpointing=True,
                                         gradient_checkpointing_kwargs={"use_reentrant": True}))
    finding = next(f for f in d.findings if f.code == "reentrant-find-unused")
    assert finding.severity == "error" and "marked as ready twice" in finding.failure
    assert "ddp_patches.apply()" in finding.fix and "unset -> True for a PeftModel" in finding.setting


def test_empty_kwargs_count_as_reentrant(tmp_path):
    d = diagnose(None, training_args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={},
                                     ddp_find_unused_parameters=True))
    assert "reentrant-find-unused" in d.codes()


def test_static_graph_with_accumulation(tmp_path):
    d = diagnose(None, training_args(tmp_path, ddp_static_graph=True, gradient_accumulation_steps=4))
    finding = next(f for f in d.findings if f.code == "static-graph-accumulation")
    assert "expect_autograd_hooks_" in finding.failure and "gradient_accumulation_steps=4" in finding.setting


def test_vision_tower_lora_with_find_unused_false(tmp_path, vision_lora_vlm):
    d = diagnose(vision_lora_vlm, training_args(tmp_path, ddp_find_unused_parameters=False))
    finding = next(f for f in d.findings if f.code == "tower-lora-find-unused-false")
    assert "finished reduction in the prior iteration" in finding.failure and "visual" in finding.setting


def test_transformers_offload_on_a_cpu_host():
    from ddp_patches.verify.hf_models import build_causal_lm

    model = build_causal_lm("llama", dtype=torch.float32)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    finding = next(f for f in diagnose(model).findings if f.code == "transformers-offload-on-cpu-host")
    assert "pin_memory" in finding.failure


def test_torchrun_on_cpu_without_use_cpu(tmp_path, monkeypatch):
    args = training_args(tmp_path, use_cpu=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    codes = diagnose(None, args).codes()
    assert "cpu-launch-without-use-cpu" in codes and "not-applied" in codes


def test_vision_tower_find_unused_false_is_fine_when_applied(tmp_path, vision_lora_vlm):
    ddp_patches.apply()  # the setting is kept and the text-only rank is handled: nothing to report
    d = diagnose(vision_lora_vlm, training_args(tmp_path, ddp_find_unused_parameters=False))
    assert "tower-lora-find-unused-false" not in d.codes()
    assert any("settings kept as given" in line for line in d.would_change)


def test_safe_setup_has_no_findings(tmp_path):
    from ddp_patches.verify.hf_models import build_lora_model

    model = build_lora_model("qwen2", None, dtype=torch.float32)  # non-reentrant
    d = diagnose(model, training_args(tmp_path, gradient_checkpointing=True,
                                      gradient_checkpointing_kwargs={"use_reentrant": False}))
    assert d.findings == []


def test_old_versions_are_an_error(monkeypatch):
    from ddp_patches import doctor

    monkeypatch.setattr(doctor, "installed_versions", lambda: {"torch": "2.1.0", "transformers": "4.40.0"})
    assert "unsupported-version" in diagnose().codes()


def test_command_line_reports_and_exits_zero_without_errors():
    out = subprocess.run([sys.executable, "-m", "ddp_patches", "doctor", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["versions"]["torch"].startswith("2.") and report["world_size"] == 1
    assert any("CheckpointFunction" in c for c in report["would_change"])


def test_dpo_with_liger_is_flagged_as_an_unwrapped_loss(tmp_path):
    from trl import DPOConfig

    from ddp_patches.doctor import diagnose

    assert "unwrapped-loss" in diagnose(None, DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_liger_kernel=True)).codes()
    assert "unwrapped-loss" not in diagnose(None, DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)).codes()
    assert any("rendezvous store" in line for line in diagnose().would_change)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="on a host without CUDA the finding is the pin_memory error")
@pytest.mark.parametrize("ours", [False, True])
def test_transformers_offload_with_and_without_ours(ours):
    from ddp_patches.verify.hf_models import build_causal_lm

    ddp_patches.apply(offload=ours)
    model = build_causal_lm("llama", dtype=torch.float32)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True}, offload=True)
    finding = next(f for f in diagnose(model).findings if f.code == "transformers-offload")
    assert ("steps aside" in finding.failure) == ours and "keeps it" in finding.failure


@pytest.mark.deepspeed
def test_a_zero2_config_is_named_and_what_acts(tmp_path):
    pytest.importorskip("deepspeed", reason="TrainingArguments(deepspeed=...) needs deepspeed (DS_BUILD_OPS=0 pip "
                                            "install --no-build-isolation deepspeed==0.19.8)")
    args = training_args(tmp_path, deepspeed={"zero_optimization": {"stage": 2}})
    finding = next(f for f in diagnose(None, args).findings if f.code == "deepspeed-zero12")
    assert "already been reduced" in finding.failure and "act under ZeRO-1/2" in finding.fix


def _one_clear_line(code, stderr: str, expected: str) -> None:
    """A usage error as argparse gives it: exit 2, no traceback, one error line that says ``expected``."""
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1] and expected in errors[0], stderr


@pytest.mark.parametrize("variable,value", [("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("RANK", "abc"),
                                            ("RANK", "-1"), ("LOCAL_WORLD_SIZE", "two"), ("LOCAL_RANK", "1.5")])
def test_command_line_names_a_bad_launch_variable(monkeypatch, capsys, variable, value):
    """A launcher variable that is not a whole number in range is one line naming it, not a traceback (WORLD_SIZE)
    nor a report that reads it as fine (the others, and a world of 0)."""
    from ddp_patches.__main__ import main

    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit:
        main(["doctor"])
    _one_clear_line(exit.value.code, capsys.readouterr().err, f"expected {variable} to be a whole number")


def test_command_with_a_bad_world_size_is_one_line():
    """The same through ``python -m ddp_patches doctor``, the process a user runs."""
    import os

    out = subprocess.run([sys.executable, "-m", "ddp_patches", "doctor"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "WORLD_SIZE": "abc"})
    _one_clear_line(out.returncode, out.stderr, "found WORLD_SIZE='abc'")


def test_diagnose_names_a_bad_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(ValueError, match="expected WORLD_SIZE to be a whole number >= 1"):
        diagnose()
