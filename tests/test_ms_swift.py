"""ms-swift's ``swift sft`` on 2 CPU ranks, with the library switched on by its ``--external_plugins`` file.

ms-swift pins other versions than this project (4.6.0: transformers 5.19, peft 0.20, trl 0.29), so these tests run in
its own virtual environment, by hand (docs/integrations.md, "ms-swift"); elsewhere they are skipped.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

try:  # ms-swift's distribution (OpenStack Swift also installs a package named swift)
    importlib.metadata.version("ms-swift")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("ms-swift is not installed: these tests run in its own venv (docs/integrations.md, 'ms-swift')",
                allow_module_level=True)

PLUGIN = "import ddp_patches\nddp_patches.apply()\n"  # the whole --external_plugins file
_ENVIRON = dict(os.environ)
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
       "NPROC_PER_NODE": "2"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny Qwen2 with its tokenizer, a chat dataset and the plugin file, written locally (no download)."""
    from tools.clients import build_assets

    root = tmp_path_factory.mktemp("swift")
    build_assets(str(root))
    (root / "plugin.py").write_text(PLUGIN)
    return root


def _sft(root, tmp_path, reentrant: bool, plugin: bool) -> tuple[int, str, list[str]]:
    """``swift sft`` LoRA with gradient checkpointing on 2 gloo ranks; (exit code, output, per-step losses)."""
    swift = os.path.join(os.path.dirname(sys.executable), "swift")  # this venv's, beside its python
    swift = swift if os.path.exists(swift) else shutil.which("swift")
    cmd = [swift, "sft", "--model", str(root / "model"), "--model_type", "qwen2", "--template", "chatml",
           "--dataset", str(root / "data" / "chat" / "train.jsonl"), "--tuner_type", "lora", "--max_steps", "3",
           "--per_device_train_batch_size", "2", "--logging_steps", "1", "--gradient_checkpointing", "true",
           "--gradient_checkpointing_kwargs", json.dumps({"use_reentrant": reentrant}),
           "--output_dir", str(tmp_path / "out"), "--save_strategy", "no", "--report_to", "none", "--use_hf", "true",
           "--torch_dtype", "float32", "--ddp_backend", "gloo", "--use_cpu", "true"]
    if plugin:
        cmd += ["--external_plugins", str(root / "plugin.py")]
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(cmd, env={**_ENVIRON, **ENV}, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    out = run.stdout + run.stderr
    return run.returncode, out, re.findall(r"'loss': '([0-9.]+)', 'grad_norm': '([0-9.]+)'", out)


def test_reentrant_checkpointing_fails_unpatched_and_trains_with_the_plugin_file(assets, tmp_path):
    """ms-swift forces the ``use_reentrant`` it was given by replacing torch.utils.checkpoint.checkpoint; LoRA with
    reentrant checkpointing under DDP then fails ("marked as ready twice"). With the plugin file the swap reaches
    torch's own function (NOTE [The swap calls torch's own checkpoint]) and the losses and gradient norms equal
    the non-reentrant run's (with the plugin too: one difference at a time). Three runs, about 2.5 minutes."""
    code, out, _ = _sft(assets, tmp_path / "unpatched", reentrant=True, plugin=False)
    assert code != 0 and "marked as ready twice" in out, out[-3000:]
    code, out, patched = _sft(assets, tmp_path / "patched", reentrant=True, plugin=True)
    assert code == 0 and "use_reentrant=True -> False under DDP" in out, out[-3000:]
    code, out, control = _sft(assets, tmp_path / "control", reentrant=False, plugin=True)  # nothing to swap
    assert code == 0, out[-3000:]
    assert len(patched) == 3 and patched == control, (patched, control)
