"""LLaMA-Factory's ``llamafactory-cli train``, unchanged, on 2 CPU ranks under its own ``FORCE_TORCHRUN=1`` launcher.

The library reaches LLaMA-Factory's ranks through ``ddp-patches-run llamafactory-cli train x.yaml``: the CLI calls
torchrun itself, and the ranks it starts inherit the start-up hook. Each failing configuration is one users run
(LLaMA-Factory's defaults: reentrant checkpointing, ``ddp_find_unused_parameters`` forced to False for LoRA), and
each is compared with the configuration that works unpatched (``ddp_find_unused_parameters: true`` and
``use_reentrant_gc: false``): the per-step losses and gradient norms, and the saved adapters, which must load with
plain PEFT in a process without this library.

LLaMA-Factory pins other versions than this project (0.9.5: transformers <= 5.6, peft <= 0.20, trl <= 0.24, and it
needs torchvision and torchaudio), so these tests run in its own virtual environment, by hand (docs/integrations.md,
"LLaMA-Factory"); elsewhere they are skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

llamafactory = pytest.importorskip(
    "llamafactory", reason="LLaMA-Factory is not installed: these tests run in its own venv (docs/integrations.md, 'LLaMA-Factory')")

import transformers  # noqa: E402  (after the skip: only LLaMA-Factory's venv gets this far)
import yaml  # noqa: E402  (LLaMA-Factory's own dependency)

pytestmark = pytest.mark.e2e

SEPARATE_EXPERTS = int(transformers.__version__.split(".")[0]) < 5
_ENVIRON = dict(os.environ)
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
       "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "DISABLE_VERSION_CHECK": "1"}
CONTROL = {"ddp_find_unused_parameters": True, "use_reentrant_gc": False}  # what works without the library
UNFINISHED = "Expected to have finished reduction in the prior iteration"
TWICE = "marked as ready twice"


def _build_moe(path: str) -> None:
    """A tiny Qwen3-MoE, 64 experts, top-2: with a few tokens per rank most experts get none, differently per rank.

    Under transformers 4.x each expert is its own module (an idle one is an unused parameter); transformers 5 fuses
    them into one parameter, and LLaMA-Factory 0.9.5 then targets attention only ("Found linear modules").
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tools.clients import tokenizer

    tok = tokenizer()
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=64, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny Qwen2 and a tiny Qwen3-MoE with their tokenizer, and a chat dataset LLaMA-Factory reads by name."""
    from tools.clients import build_assets

    root = tmp_path_factory.mktemp("lf")
    paths = build_assets(str(root))
    _build_moe(str(root / "moe"))
    info = {"chat": {"file_name": os.path.join(paths["chat"], "train.jsonl"), "formatting": "sharegpt",
                     "columns": {"messages": "messages"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}}}
    (root / "data" / "dataset_info.json").write_text(json.dumps(info))
    return root


def _yaml(root, model: str, out, extra: dict) -> dict:
    """LLaMA-Factory's LoRA SFT example, shrunk: everything it does not set is LLaMA-Factory's default."""
    config = {"model_name_or_path": str(root / model), "stage": "sft", "do_train": True, "finetuning_type": "lora",
              "lora_rank": 4, "lora_target": "all", "dataset": "chat", "dataset_dir": str(root / "data"),
              "template": "default", "cutoff_len": 64, "overwrite_cache": True, "preprocessing_num_workers": 1,
              "dataloader_num_workers": 0, "output_dir": str(out), "logging_steps": 1, "save_strategy": "no",
              "report_to": "none", "per_device_train_batch_size": 2, "learning_rate": 1.0e-3, "max_steps": 4,
              "lr_scheduler_type": "constant", "seed": 0, "use_cpu": True, "ddp_backend": "gloo"}
    return {**config, **extra}


def _train(root, tmp_path, model: str, extra: dict, patched: bool) -> tuple[int, str, list]:
    """``[ddp-patches-run] llamafactory-cli train x.yaml``; (exit code, output, [(loss, grad_norm)] per step)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(_yaml(root, model, out, extra)))
    bindir = os.path.dirname(sys.executable)  # this venv's CLIs, beside its python
    cmd = [os.path.join(bindir, "llamafactory-cli"), "train", str(config)]
    if patched:
        cmd = [os.path.join(bindir, "ddp-patches-run")] + cmd
    env = {**_ENVIRON, **ENV, "PATH": bindir + os.pathsep + _ENVIRON.get("PATH", "")}  # LLaMA-Factory calls torchrun
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    log = []
    if run.returncode == 0:
        state = json.loads((out / "trainer_state.json").read_text())
        log = [(h["loss"], h["grad_norm"]) for h in state["log_history"] if "loss" in h]
    return run.returncode, run.stdout + run.stderr, log


def _adapter_in_plain_peft(root, model: str, out) -> dict:
    """The saved adapter, loaded by PEFT in a fresh interpreter that never imports ddp_patches."""
    code = (
        "import sys, torch, peft, transformers\n"
        f"base = transformers.AutoModelForCausalLM.from_pretrained({str(root / model)!r})\n"
        f"m = peft.PeftModel.from_pretrained(base, {str(out)!r})\n"
        "assert 'ddp_patches' not in sys.modules\n"
        "torch.save({k: v for k, v in m.state_dict().items() if 'lora_' in k}, sys.argv[1])\n")
    target = os.path.join(str(out), "loaded.pt")
    subprocess.run([sys.executable, "-c", code, target], check=True, env={**_ENVIRON, **ENV}, timeout=300)
    import torch

    return torch.load(target)


def _fails_then_trains_as_control(assets, tmp_path, model: str, setting: dict, error: str) -> None:
    code, out, _ = _train(assets, tmp_path / "unpatched", model, setting, patched=False)
    assert code != 0 and error in out, out[-3000:]
    code, out, patched = _train(assets, tmp_path / "patched", model, setting, patched=True)
    assert code == 0, out[-3000:]
    assert "use_reentrant=True -> False under DDP" in out, out[-3000:]  # the swap reached LLaMA-Factory's ranks
    code, out, control = _train(assets, tmp_path / "control", model, CONTROL, patched=False)
    assert code == 0, out[-3000:]
    assert len(patched) == 4 and patched == control, (patched, control)
    mine = _adapter_in_plain_peft(assets, model, tmp_path / "patched" / "out")
    theirs = _adapter_in_plain_peft(assets, model, tmp_path / "control" / "out")
    assert mine and sorted(mine) == sorted(theirs)
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) <= 1e-6


@pytest.mark.skipif(not SEPARATE_EXPERTS, reason="transformers 5 fuses a MoE's experts into one parameter, and "
                    "LLaMA-Factory 0.9.5 then leaves them out of LoRA: install transformers 4.56.2 to run it")
def test_moe_with_llamafactory_defaults_llamafactory_9240(assets, tmp_path):
    """LlamaFactory#9240 (Qwen3-30B-A3B LoRA, transformers 4.56.2): with LLaMA-Factory's defaults an expert that no
    token of this rank reached has LoRA weights without a gradient and ``find_unused_parameters`` is False:
    "Expected to have finished reduction". Patched, the reducer's unused-parameter protocol
    (NOTE [Unused parameters without find_unused_parameters]) trains it, equal to the control."""
    _fails_then_trains_as_control(assets, tmp_path, "moe", {}, UNFINISHED)


@pytest.mark.parametrize("model", ["model", "moe"])
def test_find_unused_true_with_llamafactory_reentrant_default(assets, tmp_path, model):
    """The cure users reach for after the error above, ``ddp_find_unused_parameters: true``, meets LLaMA-Factory's
    default ``use_reentrant_gc: true``: "marked as ready twice", on a dense Qwen2 as on the MoE. Patched, the swap
    makes the checkpoints non-reentrant and the run equals the control."""
    if model == "moe" and not SEPARATE_EXPERTS:
        pytest.skip("transformers 5: LLaMA-Factory 0.9.5 leaves the fused experts out of LoRA (see above)")
    _fails_then_trains_as_control(assets, tmp_path, model, {"ddp_find_unused_parameters": True}, TWICE)
