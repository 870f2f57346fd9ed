"""The axolotl plugin (ddp_patches/integrations/axolotl.py), through axolotl's own config loader, schema and CLI.

axolotl pins other versions than this project (0.19.0: transformers 5.16.1, peft 0.20, trl 1.9), so these tests
run in axolotl's own virtual environment, by hand (docs/integrations.md, "axolotl"); elsewhere they are skipped.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("axolotl", reason="axolotl is not installed: these tests run in its own venv (docs/integrations.md, "
                                      "'axolotl')")

import ddp_patches  # noqa: E402
from ddp_patches.integrations import axolotl as plugin  # noqa: E402

pytestmark = pytest.mark.e2e

PLUGIN = "ddp_patches.integrations.axolotl.DDPPatchesPlugin"
_ENVIRON = dict(os.environ)  # as the session started: axolotl's in-process config tests write variables
# Every run: no network (axolotl's telemetry retries an unreachable host at exit for minutes without this).
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
       "AXOLOTL_DO_NOT_TRACK": "1", "LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny Qwen2 with its tokenizer and text datasets, written locally (nothing is downloaded)."""
    from tools.clients import build_assets

    root = tmp_path_factory.mktemp("axolotl")
    build_assets(str(root))
    return root


def _config(root, **extra) -> dict:
    config = {
        "base_model": str(root / "model"), "plugins": [PLUGIN],
        "datasets": [{"path": str(root / "data" / "sft" / "train.jsonl"), "type": "completion", "ds_type": "json"}],
        "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True,
        # axolotl's LoRA kernels are Triton (CUDA only)
        "lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False,
        "sequence_len": 64, "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 3,
        "num_epochs": 1, "learning_rate": 0.001, "optimizer": "adamw_torch", "lr_scheduler": "constant",
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True},
        "output_dir": str(root / "out"), "dataset_prepared_path": str(root / "prepared"), "val_set_size": 0,
        "save_strategy": "no", "logging_steps": 1, "bf16": False, "fp16": False, "tf32": False,
    }
    return {**config, **extra}


def _validated(config: dict):
    from axolotl.cli.config import prepare_plugins
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    cfg = DictDefault(config)
    prepare_plugins(cfg)  # what axolotl's load_cfg does: the plugins' schemas join before validation
    return validate_config(cfg)


def test_the_config_keys_are_applys_keywords():
    keywords = [name for name, p in inspect.signature(ddp_patches.apply).parameters.items()
                if p.kind is p.KEYWORD_ONLY]
    assert list(plugin.DDPPatchesArgs.model_fields) == [plugin.PREFIX + k for k in keywords]


def test_the_keys_are_validated_by_axolotls_schema(assets):
    cfg = _validated(_config(assets, ddp_patches_tiled_mlp=True, ddp_patches_on_unsynced="raise"))
    assert plugin.options(cfg) == {"tiled_mlp": True, "on_unsynced": "raise"}
    from pydantic import ValidationError

    for key, bad in (("ddp_patches_on_unsynced", "loud"), ("ddp_patches_tiled_mlp_shard_tokens", 0)):
        with pytest.raises(ValidationError, match=key):
            _validated(_config(assets, **{key: bad}))


def test_pre_model_load_applies_with_the_configs_options(assets):
    from axolotl.integrations.base import PluginManager

    cfg = _validated(_config(assets, ddp_patches_tiled_mlp=True))
    try:
        PluginManager.get_instance().pre_model_load(cfg)
        report = ddp_patches.api.current_report()
        assert report is not None and report.options["tiled_mlp"] is True
    finally:
        ddp_patches.revert()


def _train(assets, tmp_path, config: dict, nproc: int) -> subprocess.CompletedProcess:
    path = tmp_path / "config.json"  # YAML is a superset of JSON: axolotl reads it as its YAML
    path.write_text(json.dumps(config))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 \
        else [sys.executable]
    return subprocess.run(launch + ["-m", "axolotl.cli.train", str(path)], env={**_ENVIRON, **ENV},
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))


def test_axolotls_cli_applies_before_the_model_is_built_and_trains(assets, tmp_path):
    run = _train(assets, tmp_path, _config(assets, output_dir=str(tmp_path / "out")), nproc=1)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    applied, built = out.find("applied from axolotl's plugins list"), out.find("Loading weights")
    assert 0 <= applied < built, out[-3000:]
    assert "'train_loss'" in out


def test_two_cpu_ranks_apply_and_then_stop_where_axolotl_needs_an_accelerator(assets, tmp_path):
    """axolotl 0.19 sets ``device_map={"": LOCAL_RANK}`` whenever world_size > 1 (utils/config normalize_config,
    after its CPU branch), an accelerator index: on a host without one, from_pretrained raises before any step.
    Both ranks have applied by then; a multi-rank axolotl run needs GPUs."""
    run = _train(assets, tmp_path, _config(assets, output_dir=str(tmp_path / "out")), nproc=2)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert out.count("applied from axolotl's plugins list") == 2, out[-3000:]
    assert "Cannot access accelerator device when none is available" in out, out[-3000:]
