"""Every public failure report we know of in this area (the "Known reports" table), reproduced on 2 gloo ranks with
different data per rank: unpatched it fails the way the report says (or the pinned versions already fixed it,
asserted as such), patched it trains with gradients equal to a single process on the global batch (Trainer/TRL
runs: losses equal to the configuration that works unpatched, ranks in sync), or -- where the library cannot fix
the pattern -- it fails loudly (an error, or the guard's WARNING/ERROR), never silently.

Each test ends with ``record(...)``: the measured outcome must equal the committed row of docs/data/user-reports.json,
and the "Known reports" block of docs/compatibility.md is that file rendered (``tools/user_reports.py``), so the
table cannot claim what these tests do not measure. ``python -m tools.user_reports`` re-runs this
file and rewrites both after a deliberate change.

Raw-DDP rank functions run their unpatched, failing half on a fresh process group with a short timeout
(``_isolated``): the error is caught on the rank and the pool's default group stays usable, so an expected
failure costs no pool restart. Trainer/TRL runs build DDP on the default group: their error is caught on the rank
too, and the ranks then meet in a ``monitored_barrier``, which raises (and the pool restarts) if the failure left
the default group out of step.
"""

from __future__ import annotations

import datetime
import inspect
import json
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tools import user_reports
from tests._helpers import LibraryLog, library
from tests.test_guard import DIVERGED, UNSYNCED

REENTRANT = {"use_reentrant": True}
NON_REENTRANT = {"use_reentrant": False}
PARITY = 1e-9  # fp64 runs


def record(key: str, **measured) -> None:
    user_reports.check_or_collect(key, measured)


# -- helpers run on the ranks ----------------------------------------------------------------------------------
def _isolated(fn, *, patched: bool, timeout_s: float = 30, **options) -> dict:
    """``fn(group)`` on a fresh gloo group (DDP must be built on it); an exception is caught and returned as
    ``{"error": ...}``. A failing DDP run leaves its group unusable, not the pool's default one."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        with library(patched, **options), LibraryLog() as cap:
            result = fn(group)
        # a false alarm of the guard on a correct run would be a finding too
        return {"error": None, **result, "guard": cap.lines(UNSYNCED) + cap.lines(DIVERGED)}
    except Exception as exc:  # noqa: BLE001 - the failure is the measurement
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        import gc

        gc.collect()  # the failed DDP's reducer goes before its group
        dist.destroy_process_group(group)


def _parity(build, batch, combine, loss, group, ddp_kwargs=None, **kwargs) -> dict:
    from ddp_patches.verify.parity import run_parity

    kwargs.setdefault("lr", 0.5)
    return run_parity(build, batch, combine, loss, ddp_kwargs={"process_group": group, **(ddp_kwargs or {})},
                      **kwargs).as_dict()


def outcome(result: dict) -> str:
    """A run's outcome in the table's words: the DDP/autograd error it raised (its stable part), else whether it
    trained with parity and the ranks in sync."""
    error = result.get("error")
    if error:
        return user_reports.error_phrase(error)
    if "max_rel_error" in result:
        exact = result["max_rel_error"] <= PARITY
        sync = result.get("ranks_in_sync", True)
        if exact and sync:
            return "trains, gradient parity" + (", guard false alarm" if result.get("guard") else "")
        return "trains, ranks drift apart silently" if not sync else "trains, wrong gradients silently"
    return "trains"


def _both(pool, fn, **kwargs) -> tuple[list[dict], list[dict]]:
    """``fn`` on every rank unpatched, then patched (one pool task each; a raw DDP failure is caught on the rank)."""
    return pool.run(fn, patched=False, **kwargs), pool.run(fn, patched=True, **kwargs)


def _same(results: list[dict]) -> str:
    """Both ranks' outcome (they must agree: a rank-dependent outcome is a finding of its own)."""
    outcomes = {outcome(r) for r in results}
    assert len(outcomes) == 1, results
    return outcomes.pop()


# -- trl#480 / #835: a reward model, chosen and rejected as two forwards, one backward ---------------------------
def _reward_model(ckpt_kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from ddp_patches.verify.hf_models import LORA_TARGETS, enable_checkpointing, tiny_config

    config = tiny_config("llama")
    config.num_labels, config.pad_token_id = 1, 0
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").double()
    enable_checkpointing(model, ckpt_kwargs)
    # task_type SEQ_CLS puts the score head into modules_to_save, as TRL's reward scripts did
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, task_type="SEQ_CLS"))
    model.train()
    return model


def _pair_batch(rank: int, it: int, micro: int) -> dict:
    from ddp_patches.verify.hf_models import lm_batch

    return {"chosen": lm_batch(rank, it, micro)["input_ids"], "rejected": lm_batch(rank + 50, it, micro)["input_ids"]}


def _combine_pairs(batches: list[dict]) -> dict:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def _pairwise_loss(model, batch: dict) -> torch.Tensor:
    """TRL 0.7's RewardTrainer.compute_loss: two forwards through the same (checkpointed) layers, one backward."""
    chosen = model(input_ids=batch["chosen"]).logits
    rejected = model(input_ids=batch["rejected"]).logits
    return -nn.functional.logsigmoid(chosen - rejected).mean()


def reward_two_forwards(patched: bool) -> dict:
    return _isolated(lambda g: _parity(lambda: _reward_model(REENTRANT), _pair_batch, _combine_pairs,
                                       _pairwise_loss, g, iters=2), patched=patched)


@pytest.mark.slow
def test_trl_480_reward_two_forwards(pool):
    unpatched, patched = _both(pool, reward_two_forwards)
    assert _same(unpatched) == "error: marked as ready twice"
    assert _same(patched) == "trains, gradient parity"
    record("trl#480 / #835", unpatched=_same(unpatched), patched=_same(patched), status=user_reports.FIXED)


# -- pytorch#121594: a multi-task loss, a loop of forwards summed, LoRA + reentrant checkpointing -----------------
def test_pytorch_121594_multi_task_loss(pool):
    """The rank function is tests/test_guard.py's (which also shows the replica check naming the drift)."""
    from tests.test_guard import multi_forward_parity

    unpatched = pool.run(multi_forward_parity, patched=False)
    patched = pool.run(multi_forward_parity, patched=True)
    assert _same(unpatched) == "trains, ranks drift apart silently"
    assert _same(patched) == "trains, gradient parity" and all(r["guard"] == [] for r in patched)
    record("pytorch#121594", unpatched=_same(unpatched), patched=_same(patched), status=user_reports.FIXED)


# -- peft#899: modules_to_save keeps a trainable original_module that nothing uses ------------------------------
# Recipe fixed: transformers 5 renamed GPTNeoX's ``embed_out`` to ``lm_head``; peft 0.21 silently ignores a
# modules_to_save name that matches nothing, so the recipe's ``["embed_out"]`` wraps no module at all.
def _neox_modules_to_save(force_original_trainable: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddp_patches.verify.hf_models import VOCAB, enable_checkpointing

    config = AutoConfig.for_model("gpt_neox", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()
    enable_checkpointing(model)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"],
                                             modules_to_save=["lm_head"], task_type="CAUSAL_LM"))
    if force_original_trainable:  # what peft < 0.6 left behind (fixed by peft#905)
        model.base_model.model.lm_head.original_module.requires_grad_(True)
    model.train()
    return model


def modules_to_save_case(patched: bool, force_original_trainable: bool) -> dict:
    from ddp_patches.verify.hf_models import combine_lm, lm_batch, lm_loss

    return _isolated(lambda g: _parity(lambda: _neox_modules_to_save(force_original_trainable), lm_batch,
                                       combine_lm, lm_loss, g, iters=2), patched=patched)


def test_peft_899_modules_to_save(pool):
    """peft 0.21 freezes original_module: unpatched trains (fixed upstream). The report's state, forced here,
    fails unpatched with find_unused_parameters=False and trains with parity patched (the reach edges)."""
    as_installed = pool.run(modules_to_save_case, patched=False, force_original_trainable=False)
    assert _same(as_installed) == "trains, gradient parity"
    unpatched, patched = _both(pool, modules_to_save_case, force_original_trainable=True)
    assert _same(unpatched) == "error: expected to have finished reduction"
    assert _same(patched) == "trains, gradient parity"
    record("peft#899 / #393", unpatched=f"{_same(as_installed)} (peft {_version('peft')}); "
           f"original_module trainable: {_same(unpatched)}", patched=_same(patched), status=user_reports.UPSTREAM)


def _version(package: str) -> str:
    """A placeholder the page renders with the version the battery was recorded on (tools/user_reports.py): the row
    asserted here is the same on any version. NOTE [Rows name versions by placeholder]"""
    return user_reports.version_placeholder(package)


# -- axolotl Gemma 4: one norm Parameter shared by two checkpointed blocks ---------------------------------------
class _SharedNormStack(nn.Module):
    """Two blocks that both scale by one shared norm weight (Gemma-4-style shared per-layer norm), each block
    checkpointed by ``wrap`` (reentrant checkpoint, or torch's ``checkpoint_wrapper``)."""

    def __init__(self, wrap) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(16, dtype=torch.float64))
        self.embed = nn.Linear(16, 16, dtype=torch.float64)  # so the blocks' input requires grad, as in an LM
        self.blocks = nn.ModuleList(wrap(_NormedLinear(self.norm)) for _ in range(2))
        self.head = nn.Linear(16, 1, dtype=torch.float64)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _NormedLinear(nn.Module):
    def __init__(self, norm: nn.Parameter) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16, dtype=torch.float64)
        self.shared = [norm]  # a list, so the Parameter is registered once, on the stack

    def forward(self, x):
        return torch.tanh(self.linear(nn.functional.rms_norm(x, (16,), self.shared[0])))


class _Reentrant(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=True)


class _Offloaded(_Reentrant):
    """axolotl's offloading checkpoint (Unsloth's Function, see unsloth#3713 below)."""

    def forward(self, x):
        return _OffloadingCheckpoint.apply(self.inner, x)


def _vector_batch(rank: int, it: int, micro: int, dim: int = 16) -> torch.Tensor:
    return torch.randn(4, dim, generator=torch.Generator().manual_seed(1000 * rank + 10 * it + micro),
                       dtype=torch.float64)


def _cat(batches):
    return torch.cat(batches)


def _mse(model, x):
    return model(x).pow(2).mean()


def shared_norm_case(patched: bool, wrapper: str, find_unused: bool) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    wrap = {"reentrant": _Reentrant, "offloading": _Offloaded,
            "checkpoint_wrapper": lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT)}[wrapper]
    return _isolated(lambda g: _parity(lambda: _SharedNormStack(wrap), _vector_batch, _cat, _mse, g,
                                       ddp_kwargs={"find_unused_parameters": find_unused}, iters=2, lr=0.1),
                     patched=patched)


def test_axolotl_3584_shared_norm(pool):
    unpatched, patched = _both(pool, shared_norm_case, wrapper="reentrant", find_unused=False)
    assert _same(unpatched) == "error: marked as ready twice"
    assert _same(patched) == "trains, gradient parity"
    # axolotl's setting: non-reentrant + find_unused=True, with torch's checkpoint_wrapper ...
    unp_wrapper, pat_wrapper = _both(pool, shared_norm_case, wrapper="checkpoint_wrapper", find_unused=True)
    assert _same(unp_wrapper) == _same(pat_wrapper) == "trains, gradient parity"
    # ... and with its activation-offloading checkpoint, a custom Function the library does not swap: loud
    unp_offload, pat_offload = _both(pool, shared_norm_case, wrapper="offloading", find_unused=True)
    assert _same(unp_offload) == _same(pat_offload) == "error: marked as ready twice"
    record("axolotl Gemma 4 (#3584)", unpatched=f"reentrant: {_same(unpatched)}; non-reentrant checkpoint_wrapper "
           f"+ find_unused: {_same(unp_wrapper)}; offloading Function + find_unused: {_same(unp_offload)}",
           patched=f"reentrant: {_same(patched)}; checkpoint_wrapper: {_same(pat_wrapper)}; offloading Function: "
           f"{_same(pat_offload)} (as unsloth#3713)", status=user_reports.FIXED)


# -- accelerate#3679 / pytorch#143580: static_graph with the first micro-step under no_sync --------------------
def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).double()


def static_no_sync_case(patched: bool) -> dict:
    return _isolated(lambda g: _parity(_mlp, _vector_batch, _cat, _mse, g, ddp_kwargs={"static_graph": True},
                                       accum=2, iters=3, lr=0.1), patched=patched)


def test_accelerate_3679_static_graph_no_sync(pool):
    unpatched, patched = _both(pool, static_no_sync_case)
    assert _same(unpatched) == "error: expect_autograd_hooks_ INTERNAL ASSERT"
    assert _same(patched) == "trains, gradient parity"
    record("accelerate#3679, pytorch#143580", unpatched=_same(unpatched), patched=_same(patched),
           status=user_reports.FIXED)
    # casanovo#512: Lightning's accumulation is this order (strategy.block_backward_sync wraps the first micro-step
    # in no_sync()); Lightning itself runs it in tests/test_lightning.py
    record("casanovo#512", unpatched=_same(unpatched), patched=_same(patched), status=user_reports.FIXED)


# -- kernels-community#1081: a tiled MLP kernel that runs backward once per shard -------------------------------
class _PerShardBackwardMLP(torch.autograd.Function):
    """The hub kernel before #1083: forward in 2 token shards under no_grad; backward recomputes each shard and
    calls ``torch.autograd.backward`` on it, so each weight's AccumulateGrad (and DDP hook) fires once per shard."""

    @staticmethod
    def forward(ctx, x, mlp):
        ctx.save_for_backward(x)
        ctx.mlp = mlp
        with torch.no_grad():
            return torch.cat([type(mlp).forward(mlp, s) for s in x.chunk(2, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grads = []
        for shard, g in zip(x.chunk(2, dim=1), grad.chunk(2, dim=1)):
            shard = shard.detach().requires_grad_()
            with torch.enable_grad():
                torch.autograd.backward(type(ctx.mlp).forward(ctx.mlp, shard), g)
            grads.append(shard.grad)
        return torch.cat(grads, dim=1), None


def _llama_with_per_shard_kernel():
    import types

    from ddp_patches.verify.hf_models import build_causal_lm

    model = build_causal_lm("llama")  # full fine-tune, no checkpointing: the kernel alone breaks DDP
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(lambda self, x: _PerShardBackwardMLP.apply(x, self), layer.mlp)
    return model


def per_shard_kernel_case(patched: bool, ddp_kwargs: dict) -> dict:
    from ddp_patches.verify.hf_models import combine_lm, lm_batch, lm_loss

    return _isolated(lambda g: _parity(_llama_with_per_shard_kernel, lm_batch, combine_lm, lm_loss, g,
                                       ddp_kwargs=ddp_kwargs, iters=2), patched=patched, timeout_s=15)


def test_kernels_1081_tiled_mlp_per_shard(pool):
    """The library does not rewrite a user's kernel: patched, each DDP setting fails loudly or is exact (static
    graph with a fixed shard count is, as without the library), never silently wrong; its own tiled MLP
    (``apply(tiled_mlp=True)``, tests/test_tiled_mlp.py) has parity in every setting."""
    unpatched = pool.run(per_shard_kernel_case, patched=False, ddp_kwargs={})
    assert _same(unpatched) == "error: marked as ready twice"
    patched = {}
    for name, kwargs in {"default": {}, "find_unused": {"find_unused_parameters": True},
                         "static_graph": {"static_graph": True}}.items():
        patched[name] = _same(pool.run(per_shard_kernel_case, patched=True, ddp_kwargs=kwargs))
        assert patched[name] in ("error: marked as ready twice", "trains, gradient parity"), (name, patched[name])
    assert patched["default"] == patched["find_unused"] == "error: marked as ready twice"
    record("kernels-community#1081", unpatched=_same(unpatched),
           patched="; ".join(f"{k}: {v}" for k, v in patched.items()), status=user_reports.LOUD)


# -- transformers#47254 / trl#2514: ZeRO-3 re-partitions a frozen parameter before the recompute ---------------
class _ReleasedNormBlock(nn.Module):
    """A frozen weight gathered before the checkpointed block and released at its end, as ZeRO-3 re-partitions
    it (the report's recipe: ``.data = torch.empty(0)`` after the forward), so the recompute runs on the empty
    weight. The op that saves it broadcasts, so the recompute itself succeeds and non-reentrant checkpointing
    compares what was saved."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16, dtype=torch.float64)
        self.norm = nn.Parameter(torch.ones(16, dtype=torch.float64), requires_grad=False)
        self.linear = nn.Linear(16, 16, dtype=torch.float64)
        self.head = nn.Linear(16, 1, dtype=torch.float64)

    def _block(self, x):
        h = self.linear(x)
        out = h + (h.sum(-1, keepdim=True) * self.norm).mean(-1, keepdim=True)
        self.norm.data = torch.empty(0, dtype=torch.float64)  # "re-partitioned" after the forward
        return out

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        self.norm.data = torch.ones(16, dtype=torch.float64)  # "gathered" for the forward only
        return self.head(checkpoint(self._block, self.embed(x), use_reentrant=False))


def released_param_case(patched: bool) -> dict:
    return _isolated(lambda g: _parity(_ReleasedNormBlock, _vector_batch, _cat, _mse, g, iters=1, lr=0.1),
                     patched=patched)


def test_transformers_47254_zero3_repartitioned_param(pool):
    """Real DeepSpeed ZeRO-3 (0.19.8, CPU) does not reproduce it (tests/test_engines.py trains LoRA there with
    reentrant and non-reentrant checkpointing; the library steps aside under ZeRO-3). The recipe's emulation under
    DDP fails in the recompute with or without the library: loudly, never silently."""
    unpatched, patched = _both(pool, released_param_case)
    assert _same(unpatched).startswith("error:") and _same(patched) == _same(unpatched)
    record("transformers#47254, trl#2514", unpatched=f"emulation: {_same(unpatched)}; real ZeRO-3 (DeepSpeed "
           "0.19.8, CPU): not reproduced", patched=f"emulation: {_same(patched)} (under ZeRO-3 the library steps "
           "aside)", status=user_reports.LOUD)


# -- DeepSpeed#988 and #2103: ZeRO-2 and a weight in two reentrant checkpoints ------------------------------------
def _zero_outcome(result: dict, control: dict) -> str:
    """A DeepSpeed run's outcome: its error, or whether its weights equal the no-checkpoint control's."""
    from tests.test_zero import _max_difference

    if result["error"]:
        return user_reports.error_phrase(result["error"])
    same = _max_difference(result, control) <= 1e-6
    return "trains, weights = no-checkpoint control (<= 1e-6)" if same else "trains, weights differ from the control"


def _zero_report(pool, fn, **kwargs) -> tuple[str, str]:
    control = pool.run(fn, patched=False, **{**kwargs, "ckpt": None})
    outcomes = []
    for patched in (False, True):
        results = pool.run(fn, patched=patched, **kwargs)
        ranks = {_zero_outcome(r, c) for r, c in zip(results, control)}
        assert len(ranks) == 1, ranks
        outcomes.append(ranks.pop())
    return outcomes[0], outcomes[1]


def siamese_lora(patched: bool, ckpt="reentrant") -> dict:
    from tests.test_zero import REENTRANT as ZERO_REENTRANT
    from tests.test_zero import lora_llama

    return lora_llama(ckpt_kwargs=ZERO_REENTRANT if ckpt else None, patched=patched, second_forward=True)


def shared_block(patched: bool, ckpt="reentrant", stage=2, overlap=False) -> dict:
    from tests.test_zero import shared_weight

    return shared_weight(stage=stage, overlap=overlap, checkpoint=ckpt, patched=patched)


@pytest.mark.deepspeed
def test_deepspeed_988_two_forwards_zero2(pool):
    """The same model on two inputs (a Siamese encoder; PPO's actor for the RL and the ptx loss), losses summed, one
    backward, under ZeRO-2 with reentrant checkpointing: Llama LoRA, 2 ranks, CPU DeepSpeed."""
    unpatched, patched = _zero_report(pool, siamese_lora)
    assert unpatched == "error: has already been reduced (ZeRO)" and patched.startswith("trains, weights =")
    record("DeepSpeed#988, DeepSpeedExamples#458", unpatched=unpatched, patched=patched, status=user_reports.FIXED)


@pytest.mark.deepspeed
def test_deepspeed_2103_shared_block_zero2(pool):
    """One block applied twice, each application checkpointed (a recursive transformer; Bunny's S2 runs the vision
    tower at several scales): ZeRO-2 and ZeRO-1 with overlap_comm."""
    zero2 = _zero_report(pool, shared_block)
    zero1 = _zero_report(pool, shared_block, stage=1, overlap=True)
    assert zero1 == zero2, (zero1, zero2)
    unpatched, patched = zero2
    assert unpatched == "error: has already been reduced (ZeRO)" and patched.startswith("trains, weights =")
    record("DeepSpeed#2103, Bunny#146", unpatched=unpatched, patched=patched, status=user_reports.FIXED)


# -- pytorch#144035: torch.compile inside a non-reentrant checkpoint under DDP -----------------------------------
class _MLPInCheckpoint(nn.Module):
    """An MLP run inside a non-reentrant checkpoint; ``backend``: the MLP itself is compiled (else the caller
    compiles the DDP wrapper around it)."""

    def __init__(self, dim: int, backend: str | None) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim)).double()
        self.run_mlp = torch.compile(self.mlp, backend=backend) if backend else self.mlp
        self.head = nn.Linear(dim, 1, dtype=torch.float64)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.run_mlp, x, use_reentrant=False))


def _compiled_ddp(backend: str):
    def wrap(model, **kwargs):
        from ddp_patches.verify.parity import DDP

        return torch.compile(DDP(model, **kwargs), backend=backend)

    return wrap


def compile_case(patched: bool, dim: int, where: str, backend: str = "aot_eager") -> dict:
    """``where="inner"``: the report's recipe (a compiled MLP inside the checkpoint, DDP around); ``"outer"``:
    ``torch.compile(DDP(model))``, where DDPOptimizer splits the graph at bucket boundaries (1 MB buckets:
    one bucket at DIM 128, several at 256, the report's size dependence)."""
    options = {"ddp_kwargs": {"bucket_cap_mb": 1}, "wrap": _compiled_ddp(backend)} if where == "outer" else {}
    try:
        return _isolated(lambda g: _parity(lambda: _MLPInCheckpoint(dim, backend if where == "inner" else None),
                                           lambda r, i, m: _vector_batch(r, i, m, dim), _cat, _mse, g, iters=2,
                                           lr=0.1, **options), patched=patched)
    finally:
        torch._dynamo.reset()  # the next task of this worker must not inherit the compiled graphs


@pytest.mark.slow
def test_pytorch_144035_compile_checkpoint(pool):
    """aot_eager here (inductor compiles C++ for a minute per case on 2 cores; tried once by hand: the same
    outcome): the report's CheckpointError does not appear at either size or placement, with or without the
    library. tests/test_engines.py also runs compile(DDP) of a checkpointed LoRA LM with inductor."""
    results = {(p, d, w): _same(pool.run(compile_case, patched=p, dim=d, where=w))
               for p in (False, True) for d in (128, 256) for w in ("inner", "outer")}
    assert set(results.values()) == {"trains, gradient parity"}, results
    record("pytorch#144035", unpatched="trains, gradient parity (DIM 128 and 256; compiled MLP in the checkpoint, "
           "and compile(DDP))", patched="trains, gradient parity (all four)", status=user_reports.NOT_REPRODUCED)


# -- LlamaFactory#3102: Qwen2-MoE top-1, LoRA on the experts' down_proj, find_unused_parameters=False ----------
def _qwen2_moe_top1_lora():
    from peft import LoraConfig, get_peft_model

    from ddp_patches.verify import moe_models, tiny

    model = tiny.build("qwen2_moe", **moe_models.moe_config_extra("qwen2_moe", num_experts_per_tok=1)).double()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=REENTRANT)  # LlamaFactory's default
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=["experts.down_proj"],
                      init_lora_weights=False)
    model = get_peft_model(model, lora)
    model.train()
    return model


def _four_tokens(rank: int, it: int, micro: int) -> dict:
    from ddp_patches.verify.hf_models import lm_batch

    return lm_batch(rank, it, micro, seq=2)  # 2 rows x 2 tokens: most of the 8 experts get none


def moe_top1_case(patched: bool) -> dict:
    from ddp_patches.verify.hf_models import combine_lm, lm_loss
    from ddp_patches.verify.moe_models import idle_experts

    def run(group):
        idle = idle_experts(_qwen2_moe_top1_lora(), _four_tokens(dist.get_rank(), 0, 0))
        return {**_parity(_qwen2_moe_top1_lora, _four_tokens, combine_lm, lm_loss, group, iters=2), "idle": idle}

    return _isolated(run, patched=patched)


def test_llamafactory_3102_moe_top1(pool):
    """transformers 5 fuses each layer's experts into 3-D parameters (PEFT's target_parameters LoRA reaches them
    through a parametrization): an expert that gets no token is no longer an unused parameter."""
    unpatched, patched = _both(pool, moe_top1_case)
    assert all(min(r["idle"]) > 0 for r in unpatched), unpatched  # experts did go idle
    assert _same(unpatched) == _same(patched) == "trains, gradient parity"
    record("LlamaFactory#3102", unpatched=f"{_same(unpatched)} (experts idle; transformers "
           f"{_version('transformers')} fuses them)", patched=_same(patched), status=user_reports.UPSTREAM)


# -- unsloth#3713: a custom offloading checkpoint Function per decoder layer (reentrant by construction) -------
class _OffloadingCheckpoint(torch.autograd.Function):
    """LlamaFactory's ``UnslothGradientCheckpointing``: the layer input goes to host memory, the layer runs under
    no_grad, and backward reruns it and calls ``torch.autograd.backward`` inside (its own graph task)."""

    @staticmethod
    def forward(ctx, forward_function, hidden_states, *args):
        ctx.save_for_backward(hidden_states.to("cpu"))
        ctx.forward_function, ctx.args = forward_function, args
        with torch.no_grad():
            return forward_function(hidden_states, *args)

    @staticmethod
    def backward(ctx, grad_output):
        (hidden_states,) = ctx.saved_tensors
        hidden_states = hidden_states.detach().requires_grad_()
        with torch.enable_grad():
            output = ctx.forward_function(hidden_states, *ctx.args)
        torch.autograd.backward(output[0] if isinstance(output, tuple) else output, grad_output)
        return (None, hidden_states.grad) + (None,) * len(ctx.args)


def _offloading_checkpoint(function, hidden_states, *args, **kwargs):
    return _OffloadingCheckpoint.apply(function, hidden_states, *args)


def _lora_with_custom_checkpoint():
    from ddp_patches.verify.hf_models import build_lora_model

    model = build_lora_model("qwen2", NON_REENTRANT)  # enables the input-grad hook and checkpointing ...
    # ... then swaps torch's checkpoint for the custom one, the way LlamaFactory installs Unsloth's
    model.get_base_model()._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=_offloading_checkpoint)
    return model


def custom_checkpoint_case(patched: bool, find_unused: bool) -> dict:
    from ddp_patches.verify.hf_models import combine_lm, lm_batch, lm_loss

    return _isolated(lambda g: _parity(_lora_with_custom_checkpoint, lm_batch, combine_lm, lm_loss, g,
                                       ddp_kwargs={"find_unused_parameters": find_unused}, iters=2),
                     patched=patched, timeout_s=15)


def test_unsloth_3713_custom_offloading_checkpoint(pool):
    """find_unused_parameters=True (the HF Trainer's choice for a PeftModel, TRL's for VLMs): "marked as ready
    twice", patched too -- the library swaps torch's reentrant checkpoint, not a user's Function -- so it fails
    loudly; with find_unused_parameters=False the same Function trains exactly, with or without the library."""
    unpatched, patched = _both(pool, custom_checkpoint_case, find_unused=True)
    assert _same(unpatched) == _same(patched) == "error: marked as ready twice"
    unp_off, pat_off = _both(pool, custom_checkpoint_case, find_unused=False)
    assert _same(unp_off) == _same(pat_off) == "trains, gradient parity"
    record("unsloth#3713", unpatched=f"find_unused: {_same(unpatched)}; without: {_same(unp_off)}",
           patched=f"find_unused: {_same(patched)}; without: {_same(pat_off)}", status=user_reports.LOUD)


# -- trl#5282 / #5934, openvla-oft#160: the loss from the inner decoder and a hand-written lm_head ----------------
def inner_model_loss(patched: bool, steps: int = 2) -> dict:
    """GKD/GOLD's Liger JSD path: ``model.module.model(...)`` then the lm_head matmul by hand; DDP's forward never
    runs, so nothing is averaged. Returns what the guard logged and whether the ranks ended in sync."""
    from ddp_patches.verify.hf_models import build_lora_model, lm_batch
    from ddp_patches.verify.parity import DDP, params_equal_across_ranks

    rank = dist.get_rank()
    with library(patched), LibraryLog() as cap:
        torch.manual_seed(0)
        ddp = DDP(build_lora_model("qwen2", None))
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.5)
        for it in range(steps):
            cap.step = it + 1
            batch = lm_batch(rank, it, 0)
            causal = ddp.module.get_base_model()
            hidden = causal.model(input_ids=batch["input_ids"]).last_hidden_state
            logits = hidden @ causal.lm_head.weight.T
            nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        in_sync = params_equal_across_ranks(ddp.module)
    return {"in_sync": in_sync, "unsynced": cap.lines(UNSYNCED), "all": cap.records}


DRIFT_SILENT = "trains, ranks drift apart silently"
DRIFT_WARNED = "trains, ranks drift apart; guard WARNING at step 1 on every rank (never averaged)"


def _silent_or_loud(results: list[dict]) -> str:
    """Whether the ranks drifted, and whether the guard said so at the first step on every rank (or nothing was
    logged at all)."""
    if all(r["unsynced"] and r["unsynced"][0][:2] == (1, "WARNING") for r in results):
        return DRIFT_WARNED if not any(r["in_sync"] for r in results) else "trains in sync, guard WARNING"
    assert not any(r["all"] for r in results), results
    return DRIFT_SILENT if not any(r["in_sync"] for r in results) else "trains, ranks in sync"


def test_trl_5282_inner_model_loss(pool):
    unpatched, patched = _both(pool, inner_model_loss)
    assert _silent_or_loud(unpatched) == DRIFT_SILENT
    assert _silent_or_loud(patched) == DRIFT_WARNED
    record("trl#5282 / #5934, openvla-oft#160", unpatched=DRIFT_SILENT, patched=DRIFT_WARNED, status=user_reports.LOUD)


# -- trl#6617: a VLM fully fine-tuned on text only: the vision tower is trainable and never used ----------------
def _qwen2_vl_full(ckpt_kwargs):
    import transformers

    from ddp_patches.verify.vlm_models import SPECS

    spec = SPECS["qwen2_vl"]
    model = getattr(transformers, spec.model_class)._from_config(spec.config(), attn_implementation="eager")
    model = model.double()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    model.train()
    return model


def _text_only(rank: int, it: int, micro: int) -> dict:
    from ddp_patches.verify.vlm_models import vlm_batch

    return vlm_batch("qwen2_vl", rank, it, micro, text_only_rank=rank)


def vlm_text_only_full_case(patched: bool, trl_default: bool = False) -> dict:
    """The report's setting: reentrant checkpointing, for which TRL keeps ``find_unused_parameters`` off (the Trainer
    sets it off for a PreTrainedModel with checkpointing): DDP defaults. ``trl_default``: TRL 1.16's own choice for a
    VLM, non-reentrant with find_unused_parameters=True."""
    from ddp_patches.verify.hf_models import combine_lm, lm_loss

    ckpt, ddp_kwargs = (NON_REENTRANT, {"find_unused_parameters": True}) if trl_default else (REENTRANT, {})
    return _isolated(lambda g: _parity(lambda: _qwen2_vl_full(ckpt), _text_only, combine_lm, lm_loss, g,
                                       ddp_kwargs=ddp_kwargs, iters=2), patched=patched, timeout_s=15)


def test_trl_6617_vlm_text_only_full_ft(pool):
    unpatched, patched = _both(pool, vlm_text_only_full_case)
    assert _same(unpatched) == "error: expected to have finished reduction"
    assert _same(patched) == "trains, gradient parity"
    unp_default, pat_default = _both(pool, vlm_text_only_full_case, trl_default=True)
    assert _same(unp_default) == _same(pat_default) == "trains, gradient parity"
    record("trl#6617", unpatched=f"reentrant: {_same(unpatched)}; TRL's default (non-reentrant + find_unused): "
           f"{_same(unp_default)}", patched=f"both: {_same(patched)}", status=user_reports.FIXED)


# -- LlamaFactory#5680: Qwen2-VL LoRA on text and vision, one rank gets an image, the other text only ----------
def vlm_text_only_rank_case(patched: bool) -> dict:
    from ddp_patches.verify.vlm_models import vlm_parity

    def run(group):
        return vlm_parity("qwen2_vl", REENTRANT, lora_on_vision=True, ddp_kwargs={"process_group": group},
                          text_only_rank=1).as_dict()

    return _isolated(run, patched=patched, timeout_s=10)


def test_llamafactory_5680_vlm_text_only_rank(pool):
    """The text-only rank raises at its next forward; the rank with the image waits in the all-reduce of the vision
    LoRA gradients the other rank never sends (a hang on NCCL; here the group's short timeout)."""
    unpatched, patched = _both(pool, vlm_text_only_rank_case)
    assert outcome(unpatched[1]) == "error: expected to have finished reduction"
    assert unpatched[0]["error"], unpatched[0]  # blocked until the text-only rank's group went away
    assert _same(patched) == "trains, gradient parity"
    record("LlamaFactory#5680 / #5657 / #6376", unpatched=f"text-only rank: {outcome(unpatched[1])}; the image "
           "rank blocks in the all-reduce (a hang on NCCL)", patched=_same(patched), status=user_reports.FIXED)


# -- TRL trainers (DPO, KTO, GRPO) with LoRA through peft_config, as the reports configure them ------------------
def _trl_trainer(kind: str, root: str, ckpt_kwargs, steps: int, qlora: bool = False):
    """TRL's real trainer on the offline tiny Qwen2 (tools.clients), LoRA on every linear layer
    (``qlora``: on the model loaded 4-bit, bitsandbytes nf4 on CPU), checkpointing through the config with
    ``ckpt_kwargs``, the Trainer's own DDP settings."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    import trl
    from tools.clients import length_reward

    common = dict(output_dir=f"{root}/out", per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-2,
                  use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1,
                  gradient_checkpointing=True, gradient_checkpointing_kwargs=ckpt_kwargs, seed=0,
                  dataloader_num_workers=0, disable_tqdm=True)
    pairs = Dataset.from_json(f"{root}/data/dpo/train.jsonl")
    extra: dict = {}
    if kind == "dpo":  # no ref model: the reference pass runs with the adapter disabled
        args, data = trl.DPOConfig(**common, max_length=32), pairs
    elif kind == "kto":  # unpaired: each pair becomes a desirable and an undesirable example (KL pass on)
        rows = [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
                for p in pairs for key in ("chosen", "rejected")]
        args, data = trl.KTOConfig(**common, max_length=32), Dataset.from_list(rows)
    elif kind == "grpo":  # generation under no_grad, then the training forward; a reward with no model
        args = trl.GRPOConfig(**common, num_generations=2, max_completion_length=6)
        data, extra = Dataset.from_json(f"{root}/data/grpo/train.jsonl"), {"reward_funcs": length_reward}
    else:
        raise ValueError(kind)
    quantized = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.float32)} if qlora else {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(f"{root}/model", dtype=torch.float32, **quantized)
    trainer_class = {"dpo": trl.DPOTrainer, "kto": trl.KTOTrainer, "grpo": trl.GRPOTrainer}[kind]
    return trainer_class(model=model, args=args, train_dataset=data,
                         processing_class=AutoTokenizer.from_pretrained(f"{root}/model"),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
                         **extra)


def trl_run(kind: str, patched: bool, ckpt_kwargs, steps: int = 2, qlora: bool = False) -> dict:
    """One TRL run; an error is caught on the rank and returned. The ranks then meet in a monitored barrier: if the
    failure left the default group out of step, that raises and the pool restarts."""
    from tools.clients import build_datasets, build_model_dir
    from ddp_patches.verify.hf_models import _barrier, _shared_tmpdir
    from ddp_patches.verify.parity import params_equal_across_ranks

    with _shared_tmpdir() as root:
        if dist.get_rank() == 0:  # transformers saves on rank 0 only under a process group
            build_model_dir(f"{root}/model")
            build_datasets(f"{root}/data")
        _barrier()
        try:
            with library(patched), LibraryLog() as cap:
                trainer = _trl_trainer(kind, root, ckpt_kwargs, steps, qlora)
                trainer.train()
        except Exception as exc:  # noqa: BLE001 - the failure is the measurement
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
            return {"error": f"{type(exc).__name__}: {exc}"}
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return {"error": None, "losses": losses, "steps": trainer.state.global_step,
                "in_sync": params_equal_across_ranks(trainer.model),
                "guard": cap.lines(UNSYNCED) + cap.lines(DIVERGED),
                "4bit": any(type(m).__name__ == "Linear4bit" for m in trainer.model.modules())}


def _trl_outcomes(pool, kind: str, **kwargs) -> tuple[str, str]:
    """The report's setting (reentrant) unpatched and patched; patched must train with the per-step losses of the
    setting that works unpatched (non-reentrant, the pinned versions' default) and identical weights on both
    ranks."""
    unpatched = pool.run(trl_run, kind=kind, patched=False, ckpt_kwargs=REENTRANT, **kwargs)
    working = pool.run(trl_run, kind=kind, patched=False, ckpt_kwargs=NON_REENTRANT, **kwargs)
    patched = pool.run(trl_run, kind=kind, patched=True, ckpt_kwargs=REENTRANT, **kwargs)
    assert all(r["error"] is None for r in working + patched), working + patched
    for ok, good in zip(patched, working):
        assert ok["steps"] == good["steps"] and ok["losses"] == good["losses"], (ok, good)
        assert ok["in_sync"] and ok["guard"] == [], ok  # no false alarm of the guard either
        assert ok["4bit"] == kwargs.get("qlora", False)
    return _same(unpatched), "trains, losses = non-reentrant run, ranks in sync"


def test_trl_4782_dpo_lora_reentrant(pool):
    unpatched, patched = _trl_outcomes(pool, "dpo")
    assert unpatched == "error: marked as ready twice"
    record("trl#4782", unpatched=unpatched, patched=patched, status=user_reports.FIXED)


def test_axolotl_2420_kto_reentrant(pool):
    unpatched, patched = _trl_outcomes(pool, "kto", qlora=True)  # the report's QLoRA
    assert unpatched == "error: marked as ready twice"
    record("axolotl#2420", unpatched=unpatched, patched=patched, status=user_reports.FIXED)


def test_ms_swift_3171_grpo_reentrant(pool):
    unpatched, patched = _trl_outcomes(pool, "grpo")
    assert unpatched == "error: marked as ready twice"
    record("ms-swift#3171, trl#3089", unpatched=unpatched, patched=patched, status=user_reports.FIXED)


# -- trl#7245: DPO's loss on the unwrapped model (the Liger path): DDP never averages ---------------------------
def test_trl_7245_unwrapped_dpo(pool):
    """The rank function is tests/test_guard.py's (which also covers on_unsynced='raise' and the wrapped DPO)."""
    from tests.test_guard import unwrapping_dpo

    unpatched, patched = pool.run(unwrapping_dpo, patched=False), pool.run(unwrapping_dpo)
    assert all(r["steps"] == 2 for r in unpatched + patched)
    assert _silent_or_loud(unpatched) == DRIFT_SILENT
    assert _silent_or_loud(patched) == DRIFT_WARNED
    record("trl#7245", unpatched=DRIFT_SILENT, patched=DRIFT_WARNED, status=user_reports.LOUD)


# -- trl#921: SFTTrainer, QLoRA through prepare_model_for_kbit_training (reentrant `{}` kwargs) ----------------
def sft_qlora_run(patched: bool, ckpt_kwargs) -> dict:
    """trainer_runs.train('sft', qlora=True): a tiny Llama re-loaded 4-bit (bitsandbytes nf4 on CPU),
    ``prepare_model_for_kbit_training``, LoRA; an error is caught as in ``trl_run``."""
    from ddp_patches.verify.trainer_runs import train

    try:
        with library(patched):
            result = train("sft", qlora=True, ckpt_kwargs=ckpt_kwargs, accum=1, steps=2)
    except Exception as exc:  # noqa: BLE001 - the failure is the measurement
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, **result}


def test_trl_921_sft_qlora_kbit(pool):
    """As reported (no checkpoint kwargs, peft's ``{}``) the pinned TRL trains: SFTTrainer sets
    ``use_reentrant=False`` when the kwargs do not say (TRL >= 0.27). Asked for explicitly, reentrant
    checkpointing with the Trainer's DDP choice for a PeftModel (find_unused_parameters=True) still fails."""
    as_reported = pool.run(sft_qlora_run, patched=False, ckpt_kwargs={})
    unpatched = pool.run(sft_qlora_run, patched=False, ckpt_kwargs=REENTRANT)
    working = pool.run(sft_qlora_run, patched=False, ckpt_kwargs=None)
    patched = pool.run(sft_qlora_run, patched=True, ckpt_kwargs=REENTRANT)
    assert all(r["error"] is None and r["lora_in_sync"] for r in as_reported + working + patched)
    assert _same(unpatched) == "error: marked as ready twice"
    for ok, good in zip(patched, working):
        assert ok["losses"] == good["losses"], (ok, good)
    record("trl#921", unpatched=f"kwargs `{{}}`: trains (TRL {_version('trl')} makes it non-reentrant); "
           f"use_reentrant=True: {_same(unpatched)}", patched="trains, losses = non-reentrant run, ranks in sync",
           status=user_reports.UPSTREAM)


# -- the docs table -----------------------------------------------------------------------------------------------
@pytest.mark.docs
def test_every_report_has_a_test_and_a_committed_row():
    tests = {name for name, _ in inspect.getmembers(sys.modules[__name__], inspect.isfunction)}
    missing = [r.test for r in user_reports.REPORTS if r.test not in tests]
    assert not missing, missing
    with open(user_reports.JSON_PATH, encoding="utf-8") as f:
        assert list(json.load(f)["reports"]) == [r.key for r in user_reports.REPORTS]


@pytest.mark.docs
def test_docs_block_is_the_committed_battery_rendered():
    from tools import compat

    with open(user_reports.JSON_PATH, encoding="utf-8") as f:
        data = json.load(f)
    block = compat.read_block(user_reports.PAGE, user_reports.START, user_reports.END)
    assert block == user_reports.render(data), "re-run `python -m tools.user_reports --render-only`"
