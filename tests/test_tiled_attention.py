"""Tiled attention: single-process fp64 parity (outputs and every gradient) per family, the projections' forward
count under checkpointing, unknown attention untiled, and 2-rank DDP parity against the global batch."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import ddp_patches
from ddp_patches import tiled_attention, tiled_mlp

# gemma3_text: q/k norms on heads already transposed; cohere: a parallel block (the MLP reads the input norm too)
# whose LayerNorm computes in float32 even in fp64, so each gradient through it carries float32 rounding
FAMILIES = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mistral", "cohere"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _lora(model, *, trainable_norms: bool = True):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # B starts at zero: every gradient nonzero
            if trainable_norms and ("norm" in name or name.endswith("bias")):
                p.requires_grad_(True)  # norm weights (input, q/k) and q/k/v biases get gradients too
    return model.train()


def _family(model_type: str, checkpointed: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddp_patches.verify.hf_models import enable_checkpointing

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()
    if checkpointed:
        enable_checkpointing(model, {"use_reentrant": False})
    return _lora(model)


def _step(model, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(a: tuple, b: tuple, tol: float = 1e-10, float32_names: str | None = None) -> None:
    assert torch.allclose(a[0], b[0], rtol=tol, atol=0), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        ga, gb = a[1][name], b[1][name]
        limit = 1e-6 if float32_names and float32_names in name else tol
        assert float(ga.abs().max()) > 0, name
        assert float((ga - gb).abs().max()) <= limit * float(ga.abs().max()), name


@pytest.mark.parametrize("family,checkpointed", [(f, False) for f in FAMILIES] + [("llama", True), ("qwen3", True)])
def test_single_process_parity(family, checkpointed):
    """Outputs and every gradient (LoRA, biases, every norm weight) as untiled, in fp64: 1e-10, except where the
    family's own norm computes its weight's gradient in float32 (Gemma's (1 + w) upcasts w): summed per shard
    there, 1e-6."""
    model = _family(family, checkpointed)
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    untiled = _step(model, batch)
    before = tiled_attention.counts()["tiled_calls"]
    with tiled_attention.tile_model(model, shard_tokens=4):  # 22 tokens: 6 shards
        tiled = _step(model, batch)
    assert tiled_attention.counts()["tiled_calls"] - before >= 2  # each layer (twice under checkpointing)
    _assert_same(untiled, tiled, 1e-6 if family == "cohere" else 1e-10,
                 float32_names="norm" if family.startswith("gemma") else None)
    assert "forward" not in vars(model.get_base_model().model.layers[0].self_attn)  # restored


def test_qwen2_vl_text_decoder_parity():
    from ddp_patches.verify import vlm_models

    torch.manual_seed(0)
    model = vlm_models.build_vlm("qwen2_vl", {"use_reentrant": False}, dtype=torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    batch = vlm_models.vlm_batch("qwen2_vl", 0, 0, 0)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    untiled = _step(model, batch)
    before = tiled_attention.counts()["tiled_calls"]
    with tiled_attention.tile_model(model, shard_tokens=5):
        tiled = _step(model, batch)
    assert tiled_attention.counts()["tiled_calls"] > before  # the text decoder's; the vision tower's qkv is fused
    _assert_same(untiled, tiled)


def test_projection_forwards_under_checkpointing(monkeypatch):
    """Per step under non-reentrant checkpointing, each projection runs its forward once more than untiled (the
    backward's replay of its shards), never twice more (NOTE [The attention's own forward runs]); its frozen base
    matmul runs as often as untiled, the replay differentiating it without running it
    (NOTE [The replay skips the frozen matmul])."""
    model = _family("llama", checkpointed=True)
    calls = {"n": 0, "base": 0}
    attn = model.get_base_model().model.layers[0].self_attn
    q = attn.q_proj
    bases = {id(attn.q_proj.base_layer), id(attn.v_proj.base_layer), id(attn.o_proj.base_layer)}
    original, linear = type(q).forward, torch.nn.Linear.forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(q, *args, **kwargs)

    def counted_linear(self, x):
        calls["base"] += id(self) in bases
        return linear(self, x)

    q.forward = counted
    monkeypatch.setattr(torch.nn.Linear, "forward", counted_linear)
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}

    def per_step(tiled: bool) -> tuple[int, int]:
        with tiled_attention.tile_model(model, shard_tokens=4) if tiled else torch.enable_grad():
            _step(model, batch)  # warm-up: the first call's probes
            calls.update(n=0, base=0)
            _step(model, batch)
        return calls["n"], calls["base"]

    (untiled, untiled_base), shards = per_step(False), 6
    assert (untiled, untiled_base) == (2, 3 * 2)  # forward and recompute, for q, v and o
    assert per_step(True) == ((untiled + 1) * shards, untiled_base * shards)  # the replay runs no base matmul


def test_unknown_attention_runs_untiled(caplog):
    """An attention without q/k/v/o children (a fused qkv) is left alone, with one line saying why."""

    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x):
            return self.qkv(x)[..., :8]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.input_layernorm = Fused(), torch.nn.LayerNorm(8)

    import logging

    with caplog.at_level(logging.INFO, logger="ddp_patches"), ddp_patches.patched(tiled_attention=True):
        assert tiled_attention.discover(Layer()) == []
    assert "Fused runs untiled: no q_proj/k_proj/v_proj/o_proj submodule" in caplog.text


def test_a_hooked_projection_runs_untiled_with_exact_gradients(caplog):
    """A forward hook on q_proj would fire per shard on outputs without history: that call runs untiled, one line."""
    import logging

    model = _family("llama", checkpointed=False)
    seen = []
    model.get_base_model().model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append(o))
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    untiled = _step(model, batch)
    before = tiled_attention.counts()["tiled_calls"]
    with caplog.at_level(logging.WARNING, logger="ddp_patches"), tiled_attention.tile_model(model, shard_tokens=4):
        tiled = _step(model, batch)
    assert tiled_attention.counts()["tiled_calls"] - before == 1  # layer 1 only
    assert "runs untiled: its submodule 'q_proj' has a forward or backward hook" in caplog.text
    assert all(o.grad_fn is not None for o in seen)
    _assert_same(untiled, tiled)


def test_simulated_peak_falls():
    """memsim's machinery on one Llama-shaped LoRA bf16 layer (benchmarks/tiled_attention_bytes.py, small
    shape): tiled below the cheaper exact change (bf16 LoRA inputs), both below untiled
    (NOTE [Attention tiled by bytes]; at Llama-8B and 262K tokens: 51.1, 37.1 and 31.0 GiB)."""
    from benchmarks.tiled_attention_bytes import layer_peak

    shape = dict(hidden=512, intermediate=1792, heads=8, kv_heads=2)
    unit = 4096 * 512 * 2
    peaks = {v: layer_peak(4096, v, **shape) / unit for v in ("untiled", "bf16-lora-inputs", "tiled")}
    assert peaks["untiled"] > 25 and peaks["bf16-lora-inputs"] < 19.5 and peaks["tiled"] < 16, peaks


def test_auto_rule():
    assert tiled_attention.shard_sizes(4096 * 2, 4096, None) == [4096, 4096]
    assert len(tiled_attention.shard_sizes(262144, 4096, None)) == tiled_attention.AUTO_SHARDS
    assert tiled_attention.shard_sizes(4096, 4096, None) == [4096]  # untiled below 2 x hidden
    assert tiled_attention.shard_sizes(10, 4096, 4) == [4, 3, 3]


def test_single_process_is_untouched():
    model = _family("llama", checkpointed=False)
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    with ddp_patches.patched(tiled_attention=True, tiled_attention_shard_tokens=4):
        model(input_ids=ids, labels=ids).loss.backward()
        assert tiled_attention.counts()["tiled_calls"] == 0


def ddp_case(dtype: torch.dtype, ddp_kwargs: dict) -> dict:
    from ddp_patches.verify.hf_models import lm_parity

    def build():
        from ddp_patches.verify.hf_models import build_lora_model

        return build_lora_model("llama", {"use_reentrant": False}, dtype=dtype)

    with ddp_patches.patched(tiled_attention=True, tiled_attention_shard_tokens=4):
        result = lm_parity("llama", iters=2, reference_context=tiled_mlp.untiled, build=build,
                           ddp_kwargs=ddp_kwargs).as_dict()
        result["counts"] = tiled_attention.counts()
    return result


@pytest.mark.parametrize("dtype,tol,ddp_kwargs", [(torch.float64, 1e-9, {"find_unused_parameters": True}),
                                                  (torch.float32, 1e-4, {}),
                                                  (torch.float64, 1e-9, {"static_graph": True})])
def test_ddp_parity_with_checkpointing(pool, dtype, tol, ddp_kwargs):
    """2 ranks, different data each, compared every iteration with a single-process reference on the global batch
    (run untiled), non-reentrant checkpointing on: gradients, losses and parameters match (a hook firing twice
    would raise under find_unused and static_graph)."""
    for r in pool.run(ddp_case, dtype=dtype, ddp_kwargs=ddp_kwargs):
        assert r["max_rel_error"] <= tol, r
        assert r["ranks_in_sync"]
        assert r["counts"]["tiled_calls"] > 0


def ddp_family_case(family: str, qlora: bool = False, vlm: bool = False) -> dict:
    """2 ranks, accumulation 2, non-reentrant checkpointing, against the untiled single process on the global batch:
    ``family`` "qwen2" has q/k/v biases; the tiny "llama" is GQA (4 heads, 2 key/value heads); ``qlora``: its
    frozen linear layers in bitsandbytes NF4 (the CPU kernels), LoRA and compute in float32; ``vlm``: Qwen2-VL, the
    language model's attention tiled beside a vision tower (one rank's batches text only)."""
    from ddp_patches.verify.hf_models import lm_parity
    from ddp_patches.verify.vlm_models import vlm_parity

    with ddp_patches.patched(tiled_attention=True, tiled_attention_shard_tokens=4):
        if vlm:
            result = vlm_parity(family, {"use_reentrant": False}, accum=2, text_only_rank=1,
                                reference_context=tiled_mlp.untiled).as_dict()
        else:
            result = lm_parity(family, {"use_reentrant": False}, qlora=qlora, accum=2,
                               reference_context=tiled_mlp.untiled).as_dict()
        result["counts"] = tiled_attention.counts()
    return result


@pytest.mark.parametrize("family,qlora,vlm,tol", [("qwen2", False, False, 1e-9), ("llama", True, False, 1e-5),
                                                  ("qwen2_vl", False, True, 1e-9)],
                         ids=["qwen2-biases", "llama-gqa-qlora", "qwen2-vl-language-model"])
def test_ddp_parity_across_families(pool, family, qlora, vlm, tol):
    for r in pool.run(ddp_family_case, family=family, qlora=qlora, vlm=vlm):
        assert r["max_rel_error"] <= tol and r["ranks_in_sync"], r
        assert r["counts"]["tiled_calls"] > 0, r


def _fsdp2_bf16_lora_grads(options: dict | None, dtype=torch.bfloat16) -> dict:
    """LoRA on a tiny Llama (float32 storage, non-reentrant checkpointing) under FSDP2 computing in ``dtype``, one
    micro-batch of 2 x 512 tokens a rank; ``options``: apply()'s (None: without the library). Every LoRA gradient,
    gathered, and the tiled calls."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ddp_patches.verify.fsdp2 import shard
    from ddp_patches.verify.hf_models import build_lora_model, lm_batch
    from ddp_patches.verify.parity import full_tensor

    with ddp_patches.patched(**options) if options else contextlib.nullcontext():
        torch.manual_seed(0)
        model = build_lora_model("llama", {"use_reentrant": False}, dtype=torch.float32).train()
        shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
        model(**lm_batch(torch.distributed.get_rank(), 0, 0, seq=512)).loss.backward()
        calls = tiled_attention.counts()["tiled_calls"] + tiled_mlp.counts()["tiled_calls"] if options else 0
        return {"grads": {n: full_tensor(p.grad).double() for n, p in model.named_parameters() if p.grad is not None},
                "tiled_calls": calls}


def fsdp2_bf16_precision_case() -> dict:
    truth = _fsdp2_bf16_lora_grads(None, dtype=torch.float32)["grads"]

    def worst(grads: dict) -> float:
        return max(float((grads[n] - truth[n]).norm() / truth[n].norm()) for n in truth if truth[n].norm() > 0)

    result = {"untiled": worst(_fsdp2_bf16_lora_grads(None)["grads"])}
    for name, options in {"attention": {"tiled_attention": True, "tiled_attention_shard_tokens": 8},
                          "mlp": {"tiled_mlp": True, "tiled_mlp_shard_tokens": 8}}.items():
        run = _fsdp2_bf16_lora_grads(options)
        result[name], result[name + "_calls"] = worst(run["grads"]), run["tiled_calls"]
    return result


def test_fsdp2_bf16_shard_gradients_keep_untiled_precision(pool):
    """FSDP2 computing in bfloat16 (its unsharded LoRA parameters bfloat16), 1,024 tokens a rank in 128 shards of
    8: the worst LoRA gradient stays as close to a float32 run as untiled's (summed in bfloat16, the tiled attention's
    was 2.0x further: 0.0192 against 0.0097). NOTE [Shard gradients are summed in float32]"""
    for r in pool.run(fsdp2_bf16_precision_case):
        assert r["attention_calls"] > 0 and r["mlp_calls"] > 0, r
        assert r["attention"] <= 1.3 * r["untiled"] and r["mlp"] <= 1.3 * r["untiled"], r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="QLoRA: bitsandbytes 4-bit layers need CUDA")
def test_qlora_parity_on_cuda():  # pragma: no cover - CUDA only
    from ddp_patches.verify.hf_models import build_lora_model

    model = build_lora_model("llama", {"use_reentrant": False}, qlora=True).cuda()
    ids = torch.randint(1, 60, (2, 12), generator=torch.Generator().manual_seed(3)).cuda()
    batch = {"input_ids": ids, "labels": ids}
    untiled = _step(model, batch)
    with tiled_attention.tile_model(model, shard_tokens=4):
        tiled = _step(model, batch)
    _assert_same(untiled, tiled, tol=1e-4)


def test_options_are_checked_and_revert_restores(caplog):
    import logging

    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm

    with pytest.raises(TypeError, match="tiled_attention=...\\) expects True or False"):
        ddp_patches.apply(tiled_attention="yes")
    with pytest.raises(ValueError, match="tiled_attention_shard_tokens=...\\) expects None"):
        ddp_patches.apply(tiled_attention=True, tiled_attention_shard_tokens=0)
    with caplog.at_level(logging.WARNING, logger="ddp_patches"), ddp_patches.patched(tiled_attention_shard_tokens=8):
        pass
    assert "ignored because tiled_attention=False" in caplog.text
    originals = LlamaAttention.forward, LlamaRMSNorm.forward
    with ddp_patches.patched(tiled_attention=True, tiled_attention_shard_tokens=8):
        model = _family("llama", checkpointed=False)  # found when built (post_init)
        assert (LlamaAttention.forward, LlamaRMSNorm.forward) != originals
        assert tiled_attention.discover(model) == []  # idempotent: already patched
    assert (LlamaAttention.forward, LlamaRMSNorm.forward) == originals


@pytest.mark.parametrize("tiled", [False, True])
def test_an_inplace_edit_before_backward_raises_as_untiled(tiled):
    """tiled_mlp's NOTE [The replay reads what the forward read]: torch's version check is kept."""
    model = _family("llama", checkpointed=False)
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    before = tiled_attention.counts()["tiled_calls"]
    with tiled_attention.tile_model(model, shard_tokens=4) if tiled else torch.enable_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert tiled_attention.counts()["tiled_calls"] - before == (2 if tiled else 0)
    with torch.no_grad():
        model.get_base_model().model.layers[1].self_attn.k_proj.lora_A["default"].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_functional_call_with_substituted_parameters_is_exact():
    """Substituted LoRA weights (``functional_call``) get the untiled gradients: the replay reads what the
    forward read."""
    model = _family("llama", checkpointed=False)
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    names = [n for n, p in model.named_parameters() if "lora_A" in n]
    subs = {n: (dict(model.named_parameters())[n].detach() + 0.01).requires_grad_(True) for n in names}

    def grads(tiled: bool) -> list:
        with tiled_attention.tile_model(model, shard_tokens=4) if tiled else torch.enable_grad():
            loss = torch.func.functional_call(model, subs, (), {"input_ids": ids, "labels": ids}).loss
        return torch.autograd.grad(loss, list(subs.values()))

    before = tiled_attention.counts()["tiled_calls"]
    untiled, tiled = grads(False), grads(True)
    assert tiled_attention.counts()["tiled_calls"] - before == 2
    for a, b in zip(untiled, tiled):
        assert float(a.abs().max()) > 0 and float((a - b).abs().max()) <= 1e-10 * float(a.abs().max())


def test_a_hook_added_later_on_the_input_norm_runs_untiled_with_its_gradient():
    """The norm runs inside every q/k/v shard: a hook on it (added after the first step) would fire per shard and
    an in-place change it makes would be lost to the replay; the call runs untiled instead, exactly."""
    model = _family("llama", checkpointed=False)
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "labels": ids}
    steer = torch.nn.Parameter(torch.full((32,), 0.1, dtype=torch.float64))
    norm = model.get_base_model().model.layers[0].input_layernorm
    calls = []

    def hook(module, args, output):
        calls.append(output.shape)
        output.add_(steer)  # in place: the tensor the attention is handed

    def observer(module, args):  # reads nothing, changes nothing (as the memory simulator's phase marker)
        pass

    observer.observes_only = True
    with tiled_attention.tile_model(model, shard_tokens=4):
        with norm.register_forward_pre_hook(observer):
            before = tiled_attention.counts()["tiled_calls"]
            _step(model, batch)  # the first step tiles, the observer beside it
            assert tiled_attention.counts()["tiled_calls"] == before + 2
        handle = norm.register_forward_hook(hook)
        tiled = _step(model, batch)
        steer_grad = steer.grad.clone()
        assert calls == [torch.Size([2, 11, 32])]
    steer.grad = None
    untiled = _step(model, batch)
    handle.remove()
    _assert_same(untiled, tiled)
    assert torch.allclose(steer.grad, steer_grad, rtol=1e-10, atol=0)


def test_a_cache_without_checkpointing_trains_as_untiled():
    """use_cache left on in training (no checkpointing): the attention declines (a KV cache), after the input norm
    ran tiled with nothing of its own to differentiate; the backward still runs, exactly."""
    model = _family("llama", checkpointed=False)
    model.config.use_cache = True
    for name, p in model.named_parameters():  # LoRA only: the norm's input (the embedding) and weight need none
        p.requires_grad_("lora_" in name)
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "labels": ids, "use_cache": True}
    untiled = _step(model, batch)
    with tiled_attention.tile_model(model, shard_tokens=4):
        tiled = _step(model, batch)
    _assert_same(untiled, tiled)


def test_the_other_norms_are_tiled():
    """The norm before each MLP and the decoder's final norm run through the tiled node, and the MLP and the LM
    head are handed its output; values and every gradient as untiled. NOTE [The other norms tiled]"""
    model = _family("llama", checkpointed=True)
    base = model.get_base_model()
    handed = []

    def record(module, args):  # the forward's calls (not the recompute's): the node behind the views handed over
        node = args[0].grad_fn
        while type(node).__name__ in ("ViewBackward0", "SliceBackward0", "AliasBackward0"):
            node = node.next_functions[0][0]
        if torch._C._current_graph_task_id() == -1:
            handed.append(type(node).__name__)

    handles = [base.model.layers[0].mlp.register_forward_pre_hook(record),
               base.lm_head.register_forward_pre_hook(record)]
    ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(6))
    batch = {"input_ids": ids, "labels": ids}
    untiled = _step(model, batch)
    handed.clear()
    with tiled_attention.tile_model(model, shard_tokens=4):
        tiled = _step(model, batch)
    for h in handles:
        h.remove()
    assert handed == ["TiledMLPFunctionBackward"] * 2, handed
    _assert_same(untiled, tiled)


def test_lora_dropout_under_checkpointing_on_the_first_tiled_call():
    """The first tiled call of each attention checks its projections once (``_outside_problem``); with LoRA dropout
    that check drew from the RNG, which the checkpoint's recompute (the check cached) did not: the recompute drew
    other masks than the forward, and the first step's gradients were wrong (directional derivative 0.11 against
    0.76 by finite differences). Checked: the first step checkpointed equals the first step without."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddp_patches.verify.hf_models import enable_checkpointing

    def first_step(checkpointed: bool) -> dict:
        tiled_attention.forget()
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()
        if checkpointed:
            enable_checkpointing(model, {"use_reentrant": False})
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
        ids = torch.randint(1, 90, (2, 11), generator=torch.Generator().manual_seed(3))
        with tiled_attention.tile_model(model.train(), shard_tokens=4):
            torch.manual_seed(7)
            return _step(model, {"input_ids": ids, "labels": ids})

    _assert_same(first_step(False), first_step(True))


class _RMS(torch.nn.Module):
    def __init__(self, width: int, weight: bool = True):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.3 * torch.randn(width, dtype=torch.float64)) if weight else None

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y if self.weight is None else y * self.weight


class _HeadsFirst(torch.nn.Module):
    """A user's attention: heads transposed before the q/k norms (as Gemma3); a training-only path that norms a
    copy of q, and an in-place scale after the norm, each chosen per call."""

    def __init__(self, q_norm_weight: bool = True, heads: int = 4, dim: int = 8, width: int = 32):
        super().__init__()
        self.head_dim, self.train_path, self.scale_in_place, self.dropout = dim, False, False, 0.0
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, torch.nn.Linear(width, heads * dim, dtype=torch.float64))
        self.o_proj = torch.nn.Linear(heads * dim, width, dtype=torch.float64)
        self.q_norm, self.k_norm = _RMS(dim, q_norm_weight), _RMS(dim)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = self.q_norm(q.contiguous() if self.train_path else q)
        if self.scale_in_place:
            q.mul_(0.5)
        k = self.k_norm(self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2))
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class _Block(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.input_layernorm, self.self_attn = _RMS(32), attn

    def forward(self, x):
        return x + self.self_attn(self.input_layernorm(x))


def _grads(model, x, tiled: bool, checkpointed: bool = False) -> tuple:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    torch.manual_seed(5)  # the same attention dropout masks in both runs
    with tiled_attention.tile_model(model, shard_tokens=4) if tiled else contextlib.nullcontext():
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("change", ["training-only path", "another instance's norm", "in-place after the norm",
                                    "training-only path, checkpointed, attention dropout"])
def test_a_call_unlike_the_probe_runs_again_untiled(change, caplog):
    """A class tiles after its first call's probe; a later call that goes another way (a path the probe did not
    take, another instance whose q_norm has no weight, so the shards norm another width, or an in-place edit
    autograd refuses on the shards' views) is run again untiled, exact, with one WARNING; under checkpointing
    with attention dropout the recompute draws the forward's masks. Before: silently wrong (gradients off by 0.4
    to 1.3) or a RuntimeError untiled does not raise. The first class's calls still tile."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    cls = type("HeadsFirst", (_HeadsFirst,), {})  # a class of its own: verdicts are per class
    first = _Block(cls())
    before = tiled_attention.counts()["tiled_calls"]
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(_flat(_grads(first, x, False)),
                                                                             _flat(_grads(first, x, True))))
    assert tiled_attention.counts()["tiled_calls"] == before + 1  # the first call tiled, exact
    later = _Block(cls(q_norm_weight=change != "another instance's norm"))
    later.self_attn.train_path = change.startswith("training-only path")
    later.self_attn.scale_in_place = change == "in-place after the norm"
    checkpointed = change.endswith("dropout")
    later.self_attn.dropout = 0.3 if checkpointed else 0.0
    untiled = _grads(later, x, False, checkpointed)
    before = tiled_attention.counts()["tiled_calls"]
    with caplog.at_level(logging.WARNING, logger="ddp_patches"):
        tiled = _grads(later, x, True, checkpointed)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(_flat(untiled), _flat(tiled)))
    assert "runs untiled" in caplog.text and tiled_attention.counts()["tiled_calls"] == before
    _grads(first, x, True)
    assert tiled_attention.counts()["tiled_calls"] == before + 1  # the class's ordinary calls still tile


def _flat(result: tuple) -> list:
    return [result[0], *result[1]]
