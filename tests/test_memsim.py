"""The memory simulator (fake tensors, real model classes, the library's tiled MLP) and ``python -m ddp_patches plan``.

Calibration: the simulator's peaks beside the active peaks measured on an H100 (docs/data/gpu-proof.json), within 10%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ddp_patches import plan
from ddp_patches.plan import live_bytes, memsim, planner, search
from ddp_patches.plan import model as sim_model
from tests.harness import ROOT

GPU_PROOF = os.path.join(ROOT, "docs", "data", "gpu-proof.json")
LLAMA_8B = os.path.join(ROOT, "tests", "data", "llama-3.1-8b")
QWEN_VL_TEXT = os.path.join(ROOT, "tests", "data", "qwen2.5-vl-7b-text")
TOLERANCE = 0.02  # measured: the layers within 2 KiB, the tiled MLP 1.2% (the issue asked for 10%)
GiB = memsim.GiB


def _measured(step: str) -> dict:
    with open(GPU_PROOF, encoding="utf-8") as f:
        (found,) = [s for s in json.load(f)["steps"] if s["name"] == step]
    return found["result"]


@pytest.mark.slow
def test_calibration_offload_gpu_bound():
    """Eight Llama-8B-shaped layers (vocab 32000), LoRA r=16, bf16, at 8K and 16K, offload off and on: the active
    peak of a step above what was live before it (benchmarks/offload.py --config gpu-bound on the H100)."""
    result = _measured("offload-gpu-bound")
    config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 32768, "tie_word_embeddings": False}
    for row in result["rows"]:
        for mode, offload in (("off", False), ("on", True)):
            device, host = memsim.activation_peak(config, row["seq"], memsim.Features(offload=offload), layers=8)
            measured = row[f"active_peak_{mode}"]
            assert abs(device / measured - 1) <= TOLERANCE, (row["seq"], mode, device, measured)
            assert host == (row["moved_bytes"] if offload else 0)  # the six middle layers' inputs, as the H100 moved


def test_calibration_tiled_mlp():
    """The Llama-8B MLP (LoRA r=8 on gate/up/down, bf16) forward + backward at 8K and 32K tokens, tiled in as many
    shards as the H100 run used (its rule then left 8K untiled) and not (benchmarks/tiled_mlp.py --device cuda)."""
    for row in _measured("tiled-mlp-cuda")["rows"]:
        untiled = memsim.mlp_peak(4096, 14336, row["tokens"], tiled=False)
        tiled = memsim.mlp_peak(4096, 14336, row["tokens"], tiled=row["tiles"], shards=row["shards"])
        assert abs(untiled / row["peak_bytes_untiled"] - 1) <= TOLERANCE, (row["tokens"], untiled)
        assert abs(tiled / row["peak_bytes_tiled"] - 1) <= TOLERANCE, (row["tokens"], tiled)


@pytest.mark.slow
@pytest.mark.parametrize("config", [LLAMA_8B, QWEN_VL_TEXT], ids=["llama-3.1-8b", "qwen2.5-vl-7b-text"])
def test_real_shapes_each_feature_lowers_the_peak(config):
    """A 32K-token step at full size (32 and 28 layers, extrapolated from 3 and 4): the fused head removes the
    float32 logits, offload moves every middle layer's input to the host, the tiled MLP the MLP's intermediates."""
    seq = 32768
    plain = memsim.simulate(config, seq, memsim.Features())
    fused = memsim.simulate(config, seq, memsim.Features(fused_head=True))
    patched = memsim.simulate(config, seq, memsim.Features(tiled_mlp=True, offload=True, fused_head=True))
    text = sim_model._text_config(sim_model._config(config))
    assert plain.device > fused.device > patched.device
    assert plain.weights == patched.weights and 14 * GiB < plain.weights < 16 * GiB  # about 7.6B bf16 weights
    one_input = seq * text.hidden_size * 2
    assert patched.host == (text.num_hidden_layers - 2) * one_input  # the first and last layers' inputs stay
    assert fused.per_layer == one_input and patched.per_layer < one_input / 16  # offloaded: the input is on the host


def _tiny(tmp_path) -> str:
    """Llama's proportions (I/H = 4, V/H = 32) at hidden 512, 4 layers (run whole: no extrapolation)."""
    config = {"model_type": "llama", "vocab_size": 16384, "hidden_size": 512, "intermediate_size": 2048,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "max_position_embeddings": 1 << 20, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ddp_patches", "plan", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)


def test_the_jobs_run_after_a_parallel_op_in_the_parent():
    """plan() called from a process that already ran one parallel torch op (its OpenMP pool started, which a forked
    child cannot use): each forked job runs torch on its own thread and answers, where it used to wait forever."""
    script = ("import torch\nfrom ddp_patches.plan import planner\n"
              "def job(task):\n    return float(torch.zeros(1 << 22).add_(task[1]).sum())\n"
              "torch.ones(1 << 22).add_(1)\n"
              "print(planner._map(job, [(None, 1), (None, 2)], 2))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith(f"[{float(1 << 22)}, {float(2 << 22)}]"), out.stdout


@pytest.mark.slow
def test_plan_cli_on_a_local_config(tmp_path):
    """The planner on a local config.json, no network: each feature lengthens the longest sequence, and the
    table says it is a simulation, with one row per setup and whether ``--seq`` fits."""
    out = _plan_cli("--config", _tiny(tmp_path), "--gpu-memory", "2.5GiB", "--seq", "16384", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    longest = {row["setup"]: row["longest"] for row in result["rows"]}
    names = [s.name for s in plan.setups()]  # and the rows of features being built, where they exist
    assert 0 < longest[names[0]] < longest[names[1]] < longest[plan.PATCHED], longest
    assert longest[plan.PATCHED] >= max(longest[names[2]], longest[names[3]], longest[names[5]]), longest
    assert [row["fits_seq"] for row in result["rows"]] == [longest[n] >= 16384 for n in names]
    table = plan.render(result)
    assert "a SIMULATION" in table and "calibration: within" in table
    assert table.count("\n| ") == len(plan.setups()) + 1  # the header and one row per setup


def test_other_layouts_and_a_vlm_config(tmp_path):
    """GPT-NeoX keeps its layers in ``gpt_neox.layers`` and its decoder under another name: found without names
    (offload moves the middle layers' inputs; the fused head runs on its decoder). A VLM's own config is not a
    causal LM's: a clear error that says to pass its text config."""
    neox = {"model_type": "gpt_neox", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
            "num_hidden_layers": 4, "num_attention_heads": 4, "tie_word_embeddings": False}
    step = memsim.simulate(neox, 4096, memsim.Features(offload=True, fused_head=True))
    assert step.host == 2 * 4096 * 256 * 2  # layers 1 and 2 of 4, bf16
    vlm = {"model_type": "qwen2_5_vl", "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 256,
                                                       "num_hidden_layers": 2, "num_attention_heads": 4,
                                                       "num_key_value_heads": 2, "vocab_size": 4096}}
    with pytest.raises(ValueError, match="pass its language model's config"):
        memsim.simulate(vlm, 1024, memsim.Features())


@pytest.mark.slow
def test_plan_cli_rejects_bad_input(tmp_path):
    bad = _plan_cli("--config", _tiny(tmp_path), "--gpu-memory", "lots")
    assert bad.returncode == 2 and "expected a size such as 80GiB" in bad.stderr
    small = _plan_cli("--config", _tiny(tmp_path), "--gpu-memory", "1GiB")
    assert small.returncode == 2 and "leaves nothing for a step" in small.stderr
    rank = _plan_cli("--config", _tiny(tmp_path), "--lora-r", "0")
    assert rank.returncode == 2 and "--lora-r expects a number >= 1" in rank.stderr
    missing = _plan_cli("--config", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "expected a local config.json or a model folder" in missing.stderr


def _one_clear_line(code, stderr: str, expected: str) -> None:
    """A usage error as argparse gives it: exit 2, no traceback, one error line that says ``expected``."""
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1] and expected in errors[0], stderr


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BERT = {"model_type": "bert", "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 128}


@pytest.mark.parametrize("case", ["bert", "not-json", "a-json-list", "hidden-0", "layers-0", "heads-0", "folder",
                                  "seq-0", "seq-absurd", "gpu-memory-0", "gpu-memory-absurd", "lora-r-absurd"])
def test_plan_answers_bad_input_in_one_line(tmp_path, capsys, case):
    """Each is refused before any long simulation, with what was expected and what was found, not a traceback:
    an encoder's config (BERT builds as a "causal LM" whose attention is bidirectional), a config.json that is not
    JSON or not an object, a size of 0, a folder without config.json, and flags out of range."""
    from ddp_patches.__main__ import main

    tiny = _tiny(tmp_path)
    sized = {"hidden-0": "hidden_size", "layers-0": "num_hidden_layers", "heads-0": "num_attention_heads"}
    args, expected = {
        "bert": (["--config", _write(tmp_path, "bert.json", json.dumps(BERT))], "expected the config of a decoder"),
        "not-json": (["--config", _write(tmp_path, "c.json", "model_type: llama")], "a model's config.json (a JSON"),
        "a-json-list": (["--config", _write(tmp_path, "list.json", "[1, 2]")], "found a JSON list"),
        "folder": (["--config", str(tmp_path / "empty")], "expected a model folder holding a config.json"),
        "seq-0": (["--config", tiny, "--seq", "0"], "--seq expects a number of tokens from 1 to 16777216"),
        "seq-absurd": (["--config", tiny, "--seq", "10000000000000"], "found 10000000000000"),
        "gpu-memory-0": (["--config", tiny, "--gpu-memory", "0"], "leaves nothing for a step"),
        "gpu-memory-absurd": (["--config", tiny, "--gpu-memory", "9" * 40 + "TiB"], "at most 1 PiB"),
        "lora-r-absurd": (["--config", tiny, "--lora-r", "10000000000000"], "at most the model's hidden size (512"),
    }.get(case, (None, f"expected {sized.get(case)} >= 1 in the config; found 0"))
    (tmp_path / "empty").mkdir()
    if case in sized:
        config = {**json.loads(open(tiny).read()), sized[case]: 0}
        args = ["--config", _write(tmp_path, "zero.json", json.dumps(config))]
    with pytest.raises(SystemExit) as exit:
        main(["plan", *args])
    _one_clear_line(exit.value.code, capsys.readouterr().err, expected)


@pytest.mark.slow
def test_plan_command_on_an_encoder_config_is_one_line(tmp_path):
    """The same through ``python -m ddp_patches plan``, the process a user runs."""
    out = _plan_cli("--config", _write(tmp_path, "config.json", json.dumps(BERT)))
    _one_clear_line(out.returncode, out.stderr, "found bert, whose self-attention is bidirectional")


def test_a_config_that_fails_in_the_simulation_is_one_line(tmp_path, capsys):
    """BERT set up as a decoder (``is_decoder``) passes the decoder check but keeps 512 positions: the first step
    beyond them fails inside torch, which the planner reports as one line naming the model and the length."""
    from ddp_patches.__main__ import main

    config = _write(tmp_path, "config.json", json.dumps({**BERT, "is_decoder": True}))
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--config", config])
    _one_clear_line(exit.value.code, capsys.readouterr().err, "a step of bert at 16,384 tokens failed")


def test_longest_fits_and_a_step_beyond_its_tolerance_does_not(tmp_path):
    """The search's answer fits the usable budget; one step of its tolerance (1/64, at least 1024) more does not."""
    config = sim_model._config(_tiny(tmp_path))
    budget = int(2.5 * GiB)
    features = memsim.Features(fused_head=True)
    n, step = plan.longest(config, features, budget)
    assert step is not None and step.device <= plan.usable(budget) and n % 1024 == 0
    assert memsim.simulate(config, n + max(1024, n // 64), features).device > plan.usable(budget)


@pytest.mark.docs
def test_docs_table_is_the_committed_plans_rendered():
    """The real-shape table of docs/benchmarks.md is ``plan.readme_block`` of the committed planner outputs
    (docs/data/plan-*.json, written by
    ``python -m ddp_patches plan --config tests/data/<model> --seq 131072 --json``)."""
    results = {}
    for label, name in (("Llama-3.1-8B (32 layers)", "llama-3.1-8b"),
                        ("Qwen2.5-VL-7B language model (28 layers; tower not counted)", "qwen2.5-vl-7b-text")):
        with open(os.path.join(ROOT, "docs", "data", f"plan-{name}-80gib.json"), encoding="utf-8") as f:
            results[label] = json.load(f)
        assert results[label]["simulation"] and results[label]["budget"] == 80 * GiB
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        assert plan.readme_block(results) in f.read()


def _small(layers: int) -> dict:
    """Llama's proportions at hidden 256, ``layers`` layers (more than 4: the 3- and 4-layer extrapolation)."""
    return {"model_type": "llama", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 1024,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1 << 20, "tie_word_embeddings": False}


@pytest.mark.slow
def test_pinned_cap_keeps_the_excess_on_the_device():
    """Offload under a pinned cap (the pool's power-of-two classes): the first middle inputs go to the host, the
    rest stay on the device. Extrapolated from 3 and 4 layers it matches 6 layers run whole: host and pinned bytes
    exactly, the device peak exactly at the LM head and at most 0.5% high in a recompute."""
    config = sim_model._config(_small(6))
    features = memsim.Features(offload=True)
    seq = 8192
    one = seq * 256 * 2
    assert memsim.size_class(one) == one  # a power of two: the class is the input
    uncapped = memsim.simulate(config, seq, features)
    assert uncapped.host == 4 * one and uncapped.pinned == 4 * one and uncapped.per_layer_host == one
    for inputs in (0, 3):
        whole = memsim.activation_run(config, seq, features, layers=6, pinned_cap=inputs * one + one // 2)
        step = memsim.simulate(config, seq, features, pinned_cap=inputs * one + one // 2)
        assert whole.peak["host"] == step.host == inputs * one and whole.pinned == step.pinned == inputs * one
        assert step.activations == uncapped.activations + (4 - inputs) * one - (one if step.peak_in == "layer" else 0)
        assert 0 <= step.activations - whole.peak["device"] <= 0.005 * whole.peak["device"], (inputs, step)


@pytest.mark.slow
def test_fast_search_matches_the_exact_one():
    """NOTE [The fast search]: the fitted line and its checks give the exact search's answer (``--exact``, to the
    resolution), its step equal to the full simulation (3 and 4 layers) there, for setups with and without offload
    (under a pinned cap that binds) and the unfused head, the runs of one setup shared across two budgets."""
    config = sim_model._config(_small(6))
    budgets = (int(1.5 * GiB), int(1.75 * GiB))  # a few thousand tokens: short runs
    for features, pinned_cap in ((memsim.Features(tiled_mlp=True, offload=True, fused_head=True), 5 << 20),
                                 (memsim.Features(), None)):
        line = search._Line(config, features, pinned_cap=pinned_cap)
        for budget in budgets:
            fast, step = line.longest(budget)
            at = memsim.simulate(config, fast, features, pinned_cap=pinned_cap)
            assert step.device == at.device <= plan.usable(budget), (features, budget, fast)
            if budget == budgets[0]:
                exact, _ = plan.longest(config, features, budget, fine=True, pinned_cap=pinned_cap)
                assert fast == exact, (features, fast, exact)
                if pinned_cap:  # the cap binds: inputs stay on the GPU
                    assert at.pinned <= pinned_cap and 0 < at.host < 4 * at.per_layer_host
            else:  # the exact search's criterion: one step of the resolution more does not fit
                beyond = memsim.simulate(config, fast + 1024, features, pinned_cap=pinned_cap)
                assert beyond.device > plan.usable(budget), (features, budget, fast)


def test_plan_names_the_pinned_cap_a_row_needs():
    """NOTE [Host memory]: the default cap (a quarter of the host over its GPUs) is too small for the offload row,
    so the row names ``offload_max_pinned_bytes`` with the pinned bytes it needs, within what the host allows; a row
    that fits in the default cap says so."""
    config = sim_model._config(_small(6))
    setup = plan.SETUPS[2]  # + offload
    default_cap, most = plan.pinned_limits(3 * GiB, 8)
    assert (default_cap, most) == (96 << 20, 192 << 20)
    n, step = plan.longest_fast(config, setup.features, int(2.5 * GiB), pinned_cap=most)
    assert 0 < step.pinned <= most and step.host <= step.pinned
    how = planner._how(setup, step, default_cap)
    assert step.pinned > default_cap and f"offload_max_pinned_bytes={step.pinned}" in how
    assert "default pinned cap suffices" in planner._how(setup, step, step.pinned)


def test_qlora_static_bytes_and_the_new_features():
    """QLoRA's NF4 base (0.5 byte a weight, double-quantised absmax) for the decoder's linear weights only; the
    library's chunked loss (its own Function) and tiled attention (its tile_model) run in the simulation."""
    numel = 4096 * 14336
    assert sim_model.nf4_bytes(numel) == numel // 2 + numel // 64 + 4 * (numel // 64 // 256) + 1024 + 4 + 64
    config = sim_model._config(_small(2))
    bf16, lora = sim_model.static_bytes(config, layers=2, lora_r=8)
    nf4, lora_q = sim_model.static_bytes(config, layers=2, lora_r=8, quant="nf4")
    linear = 2 * (256 * 256 * 2 + 256 * 128 * 2 + 256 * 1024 * 3)  # q, o; k, v (2 kv heads of 64); gate, up, down
    assert lora_q == lora and bf16 - nf4 == 2 * linear - sum(
        sim_model.nf4_bytes(n) for n in [256 * 256] * 4 + [256 * 128] * 4 + [256 * 1024] * 6)
    plain = memsim.activation_run(config, 2048, memsim.Features(), layers=2)
    chunked = memsim.activation_run(config, 2048, memsim.Features(chunked_loss=True), layers=2)
    assert chunked.peak["device"] < plain.peak["device"]
    from ddp_patches import tiled_attention

    before = tiled_attention.counts()["tiled_calls"]
    mlp = memsim.activation_run(config, 4096, memsim.Features(tiled_mlp=True, fused_head=True), layers=2)
    both = memsim.activation_run(config, 4096, memsim.Features(tiled_mlp=True, fused_head=True, tiled_attention=True),
                                 layers=2)
    assert tiled_attention.counts()["tiled_calls"] > before  # the library's own code ran on the fake tensors
    assert both.peak["device"] <= mlp.peak["device"]  # at this small width the peak is the head's, not a layer's


def test_kbit_preparation_keeps_float32_hidden_states():
    """NOTE [The k-bit preparation's float32]: PEFT's prepare_model_for_kbit_training upcasts what is not stored in
    4 bits (embeddings, norms, LM head) to float32, so the static bytes grow by exactly that, and each checkpointed
    layer's input is float32 (twice the bf16 bytes a token): the residual stream runs in float32 under autocast."""
    config = sim_model._config(_small(6))
    seq = 2048
    plain = memsim.simulate(config, seq, memsim.Features(), quant="nf4")
    kbit = memsim.simulate(config, seq, memsim.Features(kbit_prep=True), quant="nf4")
    unquantised = 2 * 8192 * 256 + 256 * (2 * 6 + 1)  # embeddings, LM head, two norms a layer and the final one
    assert kbit.weights - plain.weights == unquantised * 2  # bf16 -> float32: 2 more bytes each
    assert kbit.lora == plain.lora
    assert plain.per_layer == seq * 256 * 2 and seq * 256 * 4 <= kbit.per_layer < seq * 256 * 5, kbit
    assert kbit.activations > plain.activations


@pytest.mark.docs
def test_long_context_table_is_the_committed_plans_rendered():
    """The long-context table of docs/benchmarks.md is ``plan.long_context_block`` of the committed planner outputs
    (docs/data/plan-long-context.json, written by ``python -m tools.long_context``): no figure typed by hand."""
    with open(os.path.join(ROOT, "docs", "data", "plan-long-context.json"), encoding="utf-8") as f:
        data = json.load(f)
    assert all(result["simulation"] and result["model_type"] == "llama" for result in data["results"].values())
    assert data["calibration"]["budget"] == 80 * 10**9 and data["calibration"]["quant"] == "nf4"
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        assert plan.long_context_block(data["results"], data["calibration"]) in f.read()


def test_flash_backward_workspace_is_counted():
    """FlashAttention-2's backward allocates dq in float32 and, under GQA, dk and dv expanded to every query head
    beside its outputs (NOTE [What the simulation models]): Llama-8B's 32/8 heads of 128, 4 S x H bf16 tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows, unit = 1024, 1024 * 4096 * 2
    with FakeTensorMode():
        q = torch.empty(1, 32, rows, 128, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(1, 8, rows, 128, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(1, 8, rows, 128, dtype=torch.bfloat16, requires_grad=True)
        assert live_bytes.flash_backward_workspace(q, k) == 4 * unit + 32 * rows * 4
        live = memsim.LiveBytes()
        live.exclude([q, k, v])
        with live:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            grad = torch.empty_like(out)
            out.backward(grad)
    # out, lse, the output gradient, dq, dk, dv and the workspace, all alive while the kernel runs
    assert live.peak["device"] >= (1 + 1 + 1.5 + 4) * unit, live.peak["device"] / unit


def test_peak_listing_accounts_for_the_peak():
    """``activation_run(..., record=True)``: the storages alive at the device peak, with the op that made each, add
    up to the peak (a debugging aid for what a peak is made of)."""
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    features = memsim.Features(tiled_mlp=True, offload=True, fused_head=True, tiled_attention=True)
    live = memsim.activation_run(config, 2048, features, layers=3, record=True)
    listing = live.peak_listing()
    assert sum(row[0] for row in listing) == live.peak["device"]
    assert all(row[0] > 0 and row[1] for row in listing) and listing[0][0] >= listing[-1][0], listing[:5]
