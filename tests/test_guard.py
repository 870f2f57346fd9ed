"""ddp_patches/guard/ on 2 gloo ranks fed different data: the unsynchronised-gradient guard warns (or raises) at the
first optimizer step of a loss computed through ``.module`` / an unwrapped model, stays silent for every correct
pattern, and the replica check catches a perturbed parameter without ever hanging."""

from __future__ import annotations

import logging
import re
import time


import pytest
import torch
from torch import nn

import ddp_patches
from ddp_patches.guard import replica_check, unsynced as guard
from tests._helpers import LibraryLog as _Capture  # also imported from here by other test files

UNSYNCED = "never averaged"
DIVERGED = "replica check before optimizer step"
SKIPPED = "replica check of"


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(rank: int, it: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + 10 * it + micro))


def _ddp(module: nn.Module):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module)


def _reported(lines: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """Lines of several ranks, by step (the iteration recorded, then the optimizer step a message names): a drift
    is reported by whichever rank compared (NOTE [Replica check without a wait])."""
    def step(line: tuple[int, str, str]) -> tuple[int, int]:
        named = re.search(r"optimizer step (\d+)", line[2])
        return line[0], int(named.group(1)) if named else -1

    return sorted(lines, key=step)


def _in_sync(module: nn.Module) -> bool:
    from ddp_patches.verify.parity import params_equal_across_ranks

    return params_equal_across_ranks(module)


# -- rank functions ----------------------------------------------------------------------------------------------
def raw_loop(pattern: str, on_unsynced: str = "warn", steps: int = 3, reducer: bool = True) -> dict:
    """A raw training loop in one of the patterns below; what the guard logged (or raised), and whether the ranks
    ended in sync."""
    import torch.distributed as dist

    from ddp_patches.rescue import edges

    rank = dist.get_rank()
    error = None
    with ddp_patches.patched(on_unsynced=on_unsynced, replica_check_every=0, reducer=reducer), _Capture() as cap:
        torch.manual_seed(0)
        if pattern == "gan":
            return _gan(cap, steps)
        if pattern == "lora-module":
            from ddp_patches.verify.hf_models import build_lora_model, lm_batch

            model = build_lora_model("qwen2", {"use_reentrant": True})
            loss_of = lambda m, it, micro: m(**lm_batch(rank, it, micro)).loss  # noqa: E731
        else:
            model = _mlp()
            loss_of = lambda m, it, micro: m(_batch(rank, it, micro)).pow(2).mean()  # noqa: E731
        teacher = _mlp().requires_grad_(False) if pattern == "frozen-teacher" else None
        ddp = _ddp(model)
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
        try:
            for it in range(steps):
                cap.step = it + 1
                _one_step(pattern, ddp, loss_of, it, teacher, rank)
                opt.step()
                opt.zero_grad()
        except guard.UnsynchronizedGradientsError as exc:
            error = str(exc)
        in_sync = _in_sync(ddp.module)
    return {"unsynced": cap.lines(UNSYNCED), "all": cap.records, "error": error, "in_sync": in_sync,
            "steps_done": cap.step if error is None else cap.step - 1, "rescued": edges.for_ddp(ddp) is not None}


def _one_step(pattern, ddp, loss_of, it, teacher, rank) -> None:
    if pattern in ("module", "lora-module"):
        loss_of(ddp.module, it, 0).backward()
    elif pattern == "wrapper":
        loss_of(ddp, it, 0).backward()
    elif pattern == "no_sync":
        with ddp.no_sync():
            (loss_of(ddp, it, 0) / 2).backward()
        (loss_of(ddp, it, 1) / 2).backward()
    elif pattern == "module-then-wrapper":  # accumulate locally through .module; the last micro-step syncs
        (loss_of(ddp.module, it, 0) / 2).backward()
        (loss_of(ddp, it, 1) / 2).backward()
    elif pattern == "eval-and-generate":
        with torch.no_grad():  # evaluation through the wrapper and through .module, generation-like loops
            ddp.eval()
            ddp(_batch(rank, it, 5))
            for _ in range(3):
                ddp.module(_batch(rank, it, 6))
            ddp.train()
        loss_of(ddp, it, 0).backward()
    elif pattern == "frozen-teacher":
        x = _batch(rank, it)
        target = teacher(x)  # a frozen model outside DDP: its backward writes nothing
        (ddp(x) - target).pow(2).mean().backward()
    else:
        raise ValueError(pattern)


def _gan(cap: _Capture, steps: int) -> dict:
    """Two DDPs, two optimizers: D steps on real + detached fake, then G steps through D (D's gradients are written
    again by G's backward and left for D's next step, after zero_grad)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    g, d = _ddp(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))), _ddp(_mlp())
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.05), torch.optim.SGD(d.parameters(), lr=0.05)
    for it in range(steps):
        cap.step = it + 1
        z = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank * 100 + it))
        fake = g(z)
        opt_d.zero_grad()
        (d(_batch(rank, it)).mean() - d(fake.detach()).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        d(fake).mean().backward()
        opt_g.step()
    return {"unsynced": cap.lines(UNSYNCED), "all": cap.records, "error": None,
            "in_sync": _in_sync(g.module) and _in_sync(d.module), "steps_done": steps}


def accelerate_accumulate(steps: int = 2) -> dict:
    """accelerate's Accelerator(gradient_accumulation_steps=2) loop: accumulate(), accelerator.backward()."""
    from accelerate import Accelerator

    import torch.distributed as dist

    rank = dist.get_rank()
    with ddp_patches.patched(), _Capture() as cap:
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        for it in range(2 * steps):
            cap.step = it // 2 + 1
            with accelerator.accumulate(model):
                accelerator.backward(model(_batch(rank, it)).pow(2).mean())
                opt.step()
                opt.zero_grad()
        in_sync = _in_sync(accelerator.unwrap_model(model))
    return {"unsynced": cap.lines(UNSYNCED), "all": cap.records, "in_sync": in_sync}


def accelerate_trigger_sync(on_unsynced: str = "raise", steps: int = 2, dynamo_backend: str | None = None,
                            replica_check_every: int | None = None) -> dict:
    """accelerate's documented trigger_sync_in_backward: two forwards under accelerator.no_sync(), the first
    backward local, the second inside trigger_sync_in_backward (DDP prepares itself:
    NOTE [A backward synced without a synced forward]).

    With ``dynamo_backend``, accelerate compiles the DDP-wrapped model (ACCELERATE_DYNAMO_BACKEND, as
    TrainingArguments(torch_compile=True) sets it): trigger_sync_in_backward then checks for a
    DistributedDataParallel, finds the compiled wrapper around it and does nothing, so both backwards stay local
    and the replicas drift -- with or without this library. Dynamo traces the forward, so only the replica check
    can see it."""
    import os

    from accelerate import Accelerator

    import torch.distributed as dist

    rank, error = dist.get_rank(), None
    if dynamo_backend:
        os.environ["ACCELERATE_DYNAMO_BACKEND"] = dynamo_backend  # the pool restores the environment after the task
        torch._dynamo.reset()
    checks = {} if replica_check_every is None else {"replica_check_every": replica_check_every}
    with ddp_patches.patched(on_unsynced=on_unsynced, **checks), _Capture() as cap:
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = _mlp()
        model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            for it in range(steps):
                cap.step = it + 1
                with accelerator.no_sync(model):
                    loss_a = model(_batch(rank, it, 0)).pow(2).mean()
                    loss_b = model(_batch(rank, it, 1)).pow(2).mean()
                accelerator.backward(loss_a)
                with accelerator.trigger_sync_in_backward(model):
                    accelerator.backward(loss_b)
                opt.step()
                opt.zero_grad()
        except guard.UnsynchronizedGradientsError as exc:
            error = str(exc)
        in_sync = _in_sync(accelerator.unwrap_model(model))
    return {"all": cap.records, "error": error, "in_sync": in_sync, "diverged": cap.lines(DIVERGED),
            "aside": cap.lines("steps aside for"), "compiled": type(model).__name__}


def unwrapping_trainer(on_unsynced: str = "warn", unwrap: bool = True) -> dict:
    """HF Trainer whose compute_loss calls ``self.accelerator.unwrap_model(model)(...)``, as TRL's DPO/KTO Liger
    path did (trl#7245); gradient accumulation 2 (accelerator.accumulate inside the Trainer)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from ddp_patches.verify.hf_models import build_lora_model, lm_dataset

    class UnwrappingTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inner = self.accelerator.unwrap_model(model) if unwrap else model
            outputs = inner(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    with ddp_patches.patched(on_unsynced=on_unsynced), _Capture() as cap:
        torch.manual_seed(0)
        model = build_lora_model("llama", {"use_reentrant": True}, dtype=torch.float32)
        with tempfile.TemporaryDirectory(prefix="ddp_patches_guard_") as out:
            args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                     max_steps=2, learning_rate=1e-2, save_strategy="no", report_to=[],
                                     use_cpu=True, gradient_checkpointing=True,
                                     gradient_checkpointing_kwargs={"use_reentrant": True},
                                     dataloader_num_workers=0, disable_tqdm=True, seed=0, logging_steps=1)
            trainer = UnwrappingTrainer(model=model, args=args, train_dataset=lm_dataset())
            result = _train_counting_steps(trainer, cap)
    return {"unsynced": cap.lines(UNSYNCED), **result}


def _train_counting_steps(trainer, cap: _Capture) -> dict:
    """``trainer.train()`` with ``cap.step`` set to the optimizer step each micro-batch group ends with; a guard
    error is returned, not raised."""
    from transformers import TrainerCallback

    class StepCounter(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            cap.step = state.global_step + 1

    trainer.add_callback(StepCounter())
    error = None
    try:
        trainer.train()
    except guard.UnsynchronizedGradientsError as exc:
        error = str(exc)
    return {"error": error, "steps": trainer.state.global_step, "in_sync": _in_sync(trainer.model)}


def unwrapping_dpo(on_unsynced: str = "warn", unwrap: bool = True, patched: bool = True) -> dict:
    """TRL's real DPOTrainer (LoRA through peft_config, reentrant checkpointing, accumulation 2) whose compute_loss
    runs DPO's own loss on ``self.accelerator.unwrap_model(model)``: how trl#7245's Liger path skipped DDP.
    ``patched=False``: the same run without the library (tests/test_user_reports.py)."""
    import contextlib

    import torch.distributed as dist
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from tools.clients import build_datasets, build_model_dir
    from ddp_patches.verify.hf_models import _barrier, _shared_tmpdir

    class UnwrappingDPOTrainer(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inner = self.accelerator.unwrap_model(model) if unwrap else model
            return super().compute_loss(inner, inputs, return_outputs, num_items_in_batch)

    library = ddp_patches.patched(on_unsynced=on_unsynced) if patched else contextlib.nullcontext()
    with _shared_tmpdir() as root, library, _Capture() as cap:
        if dist.get_rank() == 0:  # transformers saves on rank 0 only under a process group
            build_model_dir(f"{root}/model")
            build_datasets(f"{root}/data")
        _barrier()
        path = f"{root}/model"
        data = Dataset.from_json(f"{root}/data/dpo/train.jsonl")
        args = DPOConfig(output_dir=f"{root}/out", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=2, learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                         max_length=32, logging_steps=1, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": True}, seed=0, dataloader_num_workers=0,
                         disable_tqdm=True)
        torch.manual_seed(0)
        trainer = UnwrappingDPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path), args=args, train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(path),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
        result = _train_counting_steps(trainer, cap)
    return {"unsynced": cap.lines(UNSYNCED), "all": cap.records, **result}


# -- tests: the unsynchronised-gradient guard ------------------------------------------------------------------
def test_loss_through_module_warns_at_the_first_step_on_every_rank(pool):
    results = pool.run(raw_loop, pattern="module")
    for rank, r in enumerate(results):
        assert len(r["unsynced"]) == 1, r["all"]  # once per DDP, not once per step
        step, level, message = r["unsynced"][0]
        assert step == 1 and level == "WARNING"
        assert f"rank {rank}:" in message and "DistributedDataParallel(Sequential)" in message
        assert "'0.weight'" in message and "`.module`" in message and "unwrap" in message
        assert not r["in_sync"]  # the warning is about a real drift: the replicas did differ at the end


def test_the_guard_watches_a_ddp_built_under_reducer_false(pool):
    """NOTE [One owner of DDP.__init__]: under apply(reducer=False) the guard alone tracks each DDP built (the
    constructor's patch runs DDP's own __init__ and the guard's tracking, none of the rescue's steps)."""
    results = pool.run(raw_loop, pattern="module", reducer=False)
    for rank, r in enumerate(results):
        assert [s for s, _, _ in r["unsynced"]] == [1], r["all"]
        assert f"rank {rank}:" in r["unsynced"][0][2] and not r["in_sync"]
        assert not r["rescued"]  # the rescue's steps did not run
    assert all(r["rescued"] for r in pool.run(raw_loop, pattern="module", steps=1))


def test_loss_through_module_raises_on_request(pool):
    results = pool.run(raw_loop, pattern="module", on_unsynced="raise")
    for r in results:
        assert r["error"] is not None and UNSYNCED in r["error"]
        assert r["steps_done"] == 0  # stopped before the first step was applied
        assert r["in_sync"]  # and so nothing drifted


def test_lora_with_reentrant_checkpointing_through_module_warns(pool):
    results = pool.run(raw_loop, pattern="lora-module", steps=2)
    for r in results:
        assert [s for s, _, _ in r["unsynced"]] == [1]
        message = r["unsynced"][0][2]
        assert "lora_A" in message and "DistributedDataParallel(PeftModelForCausalLM)" in message


@pytest.mark.parametrize("pattern", ["wrapper", "no_sync", "module-then-wrapper", "eval-and-generate",
                                     "frozen-teacher", "gan"])
def test_correct_patterns_are_silent(pool, pattern):
    results = pool.run(raw_loop, pattern=pattern, on_unsynced="raise")
    for r in results:
        assert r["error"] is None and r["all"] == [], r["all"]
        assert r["in_sync"]


def test_accelerate_accumulate_is_silent(pool):
    for r in pool.run(accelerate_accumulate):
        assert r["all"] == [] and r["in_sync"], r["all"]


def test_accelerate_trigger_sync_in_backward_is_silent(pool):
    for r in pool.run(accelerate_trigger_sync):
        assert r["error"] is None and r["all"] == [] and r["in_sync"], r


def test_trl_dpo_with_unwrapped_compute_loss_warns_raises_and_the_wrapped_one_is_silent(pool):
    for rank, r in enumerate(pool.run(unwrapping_dpo)):
        assert [s for s, _, _ in r["unsynced"]] == [1], r["all"]  # at the first optimizer step, once
        assert f"rank {rank}:" in r["unsynced"][0][2] and "lora_A" in r["unsynced"][0][2]
        assert r["steps"] == 2 and not r["in_sync"]
    for r in pool.run(unwrapping_dpo, on_unsynced="raise"):
        assert r["error"] is not None and UNSYNCED in r["error"] and r["steps"] == 0 and r["in_sync"]
    for r in pool.run(unwrapping_dpo, on_unsynced="raise", unwrap=False):
        assert r["error"] is None and r["unsynced"] == [] and r["steps"] == 2 and r["in_sync"], r["all"]


def test_trainer_with_unwrapped_compute_loss_warns(pool):
    for rank, r in enumerate(pool.run(unwrapping_trainer)):
        assert len(r["unsynced"]) == 1 and r["unsynced"][0][0] == 1  # logged at the first optimizer step
        assert f"rank {rank}:" in r["unsynced"][0][2] and "lora_A" in r["unsynced"][0][2]
        assert r["steps"] == 2 and not r["in_sync"]


def test_trainer_with_unwrapped_compute_loss_raises_on_request(pool):
    for r in pool.run(unwrapping_trainer, on_unsynced="raise"):
        assert r["error"] is not None and UNSYNCED in r["error"] and r["steps"] == 0


def test_trainer_through_the_wrapper_is_silent(pool):
    for r in pool.run(unwrapping_trainer, unwrap=False, on_unsynced="raise"):
        assert r["error"] is None and r["unsynced"] == [] and r["steps"] == 2 and r["in_sync"]


def test_single_process_is_silent():
    with ddp_patches.patched(on_unsynced="raise"), _Capture() as cap:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for it in range(2):
            model(_batch(0, it)).pow(2).mean().backward()
            opt.step()
    assert cap.records == []


def pickled_ddp() -> dict:
    """torch.save(ddp) / copy.deepcopy(ddp) (PyTorch's own DDP tests do it): the guard's hooks become inert copies."""
    import copy
    import io

    import torch.distributed as dist

    with ddp_patches.patched(on_unsynced="raise"), _Capture() as cap:
        ddp = _ddp(_mlp())
        buffer = io.BytesIO()
        torch.save(ddp, buffer)
        clone = copy.deepcopy(ddp)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(_batch(dist.get_rank(), 0)).sum().backward()
        opt.step()
        for copied in (clone, loaded):  # their own hooks do nothing, and do not count for the tracked one
            copied.module(_batch(dist.get_rank(), 1)).sum().backward()
    return {"all": cap.records}


def test_a_pickled_or_copied_ddp_keeps_working(pool):
    for r in pool.run(pickled_ddp):
        assert r["all"] == []


# -- the pytorch#121594 pattern: a multi-task loss over several DDP forwards, one backward ----------------------
def _two_task_loss(model, batch: dict) -> torch.Tensor:
    """Two forwards through the (DDP) model, one backward: the LM loss on the tokens and on the tokens reversed."""
    flipped = {k: v.flip(-1) for k, v in batch.items()}
    return model(**batch).loss + model(**flipped).loss


def multi_forward_parity(patched: bool = True, checkpointing: bool = True) -> dict:
    import contextlib

    from ddp_patches.verify.hf_models import build_lora_model, combine_lm, lm_batch
    from ddp_patches.verify.parity import run_parity

    options = {"checkpointing": checkpointing, "replica_check_every": 1}
    with (ddp_patches.patched(**options) if patched else contextlib.nullcontext()), _Capture() as cap:
        result = run_parity(lambda: build_lora_model("qwen2", {"use_reentrant": True}), lm_batch, combine_lm,
                            _two_task_loss, iters=3, lr=0.5)
    return {**result.as_dict(), "guard": cap.lines(UNSYNCED) + cap.lines(DIVERGED) + cap.lines(SKIPPED)}


def test_multi_forward_loss_with_lora_and_reentrant_checkpointing_trains_in_sync(pool):
    for r in pool.run(multi_forward_parity):
        assert r["iterations"] == 3 and r["max_rel_error"] < 1e-9, r
        assert r["ranks_in_sync"] and r["guard"] == []  # checked after every step, never alarmed


def test_multi_forward_loss_diverges_without_the_swap_and_the_replica_check_catches_it(pool):
    """Without the library the pattern drifts silently (as reported); with apply(checkpointing=False) it drifts
    too, and the replica check reports it before the second step (the counting guard cannot: every forward went
    through the wrapper)."""
    unpatched = pool.run(multi_forward_parity, patched=False)
    assert all(not r["ranks_in_sync"] and r["max_rel_error"] > 0.1 for r in unpatched)
    rank0, rank1 = pool.run(multi_forward_parity, checkpointing=False)
    assert not rank1["ranks_in_sync"]
    step, level, message = _reported(rank0["guard"] + rank1["guard"])[0]  # by the later rank at that step
    assert level == "ERROR" and DIVERGED + " 2 " in message and "lora_" in message  # the first step's damage


# -- tests: the replica check ----------------------------------------------------------------------------------
def replica_perturbed(every: int = 3, steps: int = 6, perturb_before: int = 4, on_unsynced: str = "warn") -> dict:
    """Train through the wrapper; rank 1 adds 1e-4 to one element of ``2.bias`` just before optimizer step
    ``perturb_before``. Which step's check reported it, and what it said."""
    import torch.distributed as dist

    rank, error = dist.get_rank(), None
    with ddp_patches.patched(on_unsynced=on_unsynced, replica_check_every=every), _Capture() as cap:
        torch.manual_seed(0)
        ddp = _ddp(_mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for it in range(steps):
            cap.step = it + 1
            ddp(_batch(rank, it)).pow(2).mean().backward()
            if cap.step == perturb_before and rank == 1:
                with torch.no_grad():
                    ddp.module[2].bias[0] += 1e-4
            try:
                opt.step()
            except replica_check.ReplicaDivergenceError as exc:
                error = str(exc)
                break
            opt.zero_grad()
        in_sync = _in_sync(ddp.module)
    return {"diverged": cap.lines(DIVERGED), "all": cap.records, "error": error, "in_sync": in_sync}


@pytest.mark.parametrize("perturb_before,caught_at", [(4, 6), (1, 1)], ids=["mid-run", "before-the-first-step"])
def test_replica_check_names_a_perturbed_parameter_within_n_steps(pool, perturb_before, caught_at):
    """Checks before steps 1, 2, 3, 6 (every 3): a change before step 4 is caught before step 6; one made before
    the first step (a checkpoint loaded on one rank after wrapping) before step 1."""
    every = 3
    rank0, rank1 = pool.run(replica_perturbed, every=every, perturb_before=perturb_before)
    reported = _reported(rank0["all"] + rank1["all"])  # by the rank that compared: the later one at that step
    assert reported == _reported(rank0["diverged"] + rank1["diverged"]), reported
    # Once on each rank that compares, from the first check that differs (NOTE [One ERROR per drift])
    assert min(s for s, _, _ in reported) == caught_at, reported
    assert len(rank0["diverged"]) <= 1 and len(rank1["diverged"]) <= 1, reported
    step, level, message = reported[0]
    assert level == "ERROR" and step == caught_at and step - perturb_before + 1 <= every  # caught within N steps
    assert ("rank 1:" in message and "from rank 0's" in message) or \
        ("rank 0:" in message and "from rank 1's" in message)
    assert "'2.bias'" in message and "1 of 4" in message
    assert "|diff| 0.0001" in message
    assert not rank1["in_sync"]


def test_replica_check_raises_on_request(pool):
    rank0, rank1 = pool.run(replica_perturbed, on_unsynced="raise")
    errors = [r["error"] for r in (rank0, rank1) if r["error"] is not None]  # the rank(s) that compared
    assert errors and all("'2.bias'" in e for e in errors), errors


def replica_one_rank_skips(skipper: int, timeout_s: float = 2.0, after_backward: bool = False) -> dict:
    """Every step is checked; after two steps every rank but ``skipper`` takes one more optimizer step (its third
    check), the skipper does not. With ``after_backward`` that step follows a synchronised forward and backward on
    every rank (the skipper then drifts: its peers applied a step it did not), and one more step on every rank
    follows. Then one collective proves the group is still usable (no mismatched collective)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    old, replica_check.REPLICA_CHECK_TIMEOUT_S = replica_check.REPLICA_CHECK_TIMEOUT_S, timeout_s
    try:
        with ddp_patches.patched(replica_check_every=1), _Capture() as cap:
            ddp = _ddp(_mlp())
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for it in range(2):
                ddp(_batch(rank, it)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            start = time.perf_counter()
            if after_backward:
                ddp(_batch(rank, 2)).pow(2).mean().backward()
            if rank != skipper:
                opt.step()  # without a backward: no gradients, the parameters stay as they are, but it is a step
            opt.zero_grad()
            if after_backward:  # one more on every rank: the step counts now differ by one
                ddp(_batch(rank, 3)).pow(2).mean().backward()
                opt.step()
            elapsed = time.perf_counter() - start
            in_sync = _in_sync(ddp.module)
    finally:
        replica_check.REPLICA_CHECK_TIMEOUT_S = old
    return {"elapsed": elapsed, "skipped": cap.lines(SKIPPED), "all": cap.records, "in_sync": in_sync}


@pytest.mark.parametrize("skipper,after_backward", [(0, False), (1, False), (0, True)],
                         ids=["rank-0-skips", "rank-1-skips", "rank-0-skips-after-a-synchronised-backward"])
def test_no_hang_when_one_rank_skips_the_check(pool, skipper, after_backward):
    results = pool.run(replica_one_rank_skips, skipper=skipper, after_backward=after_backward, timeout=60)
    # Both ranks got to the collective at the end: no hang, the group still works
    assert all(r["in_sync"] != after_backward for r in results)
    if not after_backward:
        # Only rank 1 reaches the check: nothing ties its step to rank 0's (no synchronised forward since its previous
        # step), so it compares nothing, at once; it used to wait out the timeout. Only rank 0 does: it publishes.
        assert all(r["elapsed"] < 1.0 and r["all"] == [] for r in results), results
    else:  # rank 1's step followed a synchronised backward: it used to wait out its timeout; now nobody waits.
        # Step counts 3 compare equal parameters (rank 0's third step came an iteration later); rank 1's step 4 has
        # no partner: the run ended first (NOTE [Replica check without a wait]).
        assert all(r["elapsed"] < 1.0 and r["all"] == [] for r in results), results


# -- engines: FSDP2 builds no DDP (nothing watched); compiled DDP: replica check only ---------------------------------
def guard_under_engine(engine: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches.verify.hf_models import lm_parity

    first = next(guard._counter)  # DDPs tracked during the run: the counter's advance (same on every rank)
    with ddp_patches.patched(on_unsynced="raise", replica_check_every=1), _Capture() as cap:
        if engine == "FSDP2":
            from ddp_patches.verify.fsdp2 import lm_fsdp2_parity

            result = lm_fsdp2_parity("qwen2", {"use_reentrant": True}, accum=2)
        else:
            torch._dynamo.reset()
            result = lm_parity("qwen2", {"use_reentrant": True}, iters=2, accum=2,
                               wrap=lambda m, **kw: torch.compile(DDP(m, **kw), backend="aot_eager"))
        tracked = next(guard._counter) - first - 1
    return {**result.as_dict(), "guard": cap.lines(UNSYNCED) + cap.lines(DIVERGED) + cap.lines(SKIPPED),
            "aside": cap.lines("steps aside for"), "tracked": tracked}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["FSDP2", "torch.compile"])
def test_other_engines_train_without_a_false_alarm(pool, engine):
    results = pool.run(guard_under_engine, engine=engine, timeout=500)
    for r in results:
        assert r["ranks_in_sync"] and r["max_rel_error"] < 1e-9 and r["guard"] == [], r
    if engine == "FSDP2":
        assert all(r["tracked"] == 0 for r in results)  # no DDP: nothing is watched
    else:  # compile(DDP): dynamo traces DDP's forward and the counting hook; the guard steps aside, said once,
        assert all(r["tracked"] == 1 for r in results)  # and the replica check (every step here) stays silent
        assert len(results[0]["aside"]) == 1 and results[1]["aside"] == []


@pytest.mark.slow
def test_replica_check_stays_on_under_compile_and_catches_a_compiled_drift(pool):
    results = pool.run(accelerate_trigger_sync, on_unsynced="warn", steps=3, dynamo_backend="aot_eager",
                       replica_check_every=1, timeout=400)
    assert all(r["compiled"] == "OptimizedModule" and not r["in_sync"] for r in results), results
    assert len(results[0]["aside"]) == 1 and "replica check stays on" in results[0]["aside"][0][2]
    # The first step was local on both ranks: the check before step 2 sees it, on the rank that compared (the later
    # one at that step)
    reported = _reported(results[0]["diverged"] + results[1]["diverged"])
    assert min(s for s, _, _ in reported) == 2, reported  # then once per comparing rank: NOTE [One ERROR per drift]
    assert all(level == "ERROR" for _, level, _ in reported)


# -- two DDP groups in one job (e.g. data-parallel replicas of two pipeline stages) ------------------------------
def two_groups(steps: int = 3) -> dict:
    """Ranks {0,1} and {2,3} each train their own DDP (different models per group); within a group the replicas
    agree. The groups' fingerprints must not meet in the store (a key shared across groups: a false ERROR)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    with ddp_patches.patched(on_unsynced="raise", replica_check_every=1), _Capture() as cap:
        torch.manual_seed(rank // 2)  # a different model per group
        ddp = DDP(_mlp(), process_group=groups[rank // 2])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for it in range(steps):
            ddp(_batch(rank, it)).pow(2).mean().backward()
            if rank in (1, 3):
                time.sleep(0.3)  # both groups' rank 0 publish first: a shared key would be read after both wrote
            opt.step()
            opt.zero_grad()
    return {"all": cap.records}


@pytest.mark.slow
def test_two_ddp_groups_check_within_their_group():
    from tests.harness import DistPool

    pool = DistPool(world_size=4)
    try:
        for r in pool.run(two_groups, timeout=120):
            assert r["all"] == [], r["all"]
    finally:
        pool.close()


def watch_line() -> dict:
    with _Capture(logging.INFO) as cap, ddp_patches.patched(on_unsynced="raise", replica_check_every=7):
        _ddp(_mlp())
    return {"lines": cap.lines("the guard watches")}


def test_the_guard_says_what_it_watches(pool):
    rank0, rank1 = pool.run(watch_line)
    assert len(rank0["lines"]) == 1 and rank1["lines"] == []  # one line, rank 0
    assert rank0["lines"][0][2] == ("ddp_patches: the guard watches DistributedDataParallel(Sequential) (4 trainable "
                                    "tensors): guard: unsynchronised gradients -> raise; replica check before "
                                    "steps 1 and 2 and every 7th")


def after_the_group_is_gone() -> dict:
    """The group is destroyed (as trainer.end() does) while a watched DDP lives on; training its module in this
    process afterwards (gradients through .module, optimizer steps) must work as without the library."""
    import datetime

    import torch.distributed as dist

    rank = dist.get_rank()
    with ddp_patches.patched(on_unsynced="raise", replica_check_every=1), _Capture() as cap:
        ddp = _ddp(_mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(_batch(rank, 0)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        store = dist.distributed_c10d._get_default_store()
        dist.destroy_process_group()
        try:
            for it in range(2):
                ddp.module(_batch(rank, it)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        finally:  # give the pool its group back
            dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=120))
    return {"all": cap.records}


def test_training_on_after_the_group_is_destroyed_is_left_alone(pool):
    for r in pool.run(after_the_group_is_gone):
        assert r["all"] == []


def test_the_guard_options_reach_ddp_patches_run():
    from ddp_patches import autoapply

    env = {"DDP_PATCHES_ON_UNSYNCED": "Raise", "DDP_PATCHES_REPLICA_CHECK_EVERY": "0"}
    assert autoapply.options_from_env(env) == {"on_unsynced": "raise", "replica_check_every": 0}
    with pytest.raises(ValueError, match="DDP_PATCHES_ON_UNSYNCED='loud' is not valid: expected warn, raise or off"):
        autoapply.options_from_env({"DDP_PATCHES_ON_UNSYNCED": "loud"})


@pytest.mark.parametrize("kwargs,match", [({"on_unsynced": "loud"}, "expects 'warn', 'raise' or 'off'"),
                                          ({"replica_check_every": -1}, "steps >= 0"),
                                          ({"replica_check_every": True}, "steps >= 0")])
def test_bad_guard_options_say_what_was_expected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ddp_patches.apply(**kwargs)
    assert not ddp_patches.is_applied()


def test_both_checks_off_install_nothing_of_the_guard():
    report = ddp_patches.apply(on_unsynced="off", replica_check_every=0)
    assert not [name for name in report.installed if "optimizer" in name]


def zero_redundancy(steps: int = 3, one_tensor: bool = False) -> dict:
    """torch's ZeroRedundancyOptimizer over a DDP: each rank steps its shard with a local optimizer (a step inside
    a step) and broadcasts it afterwards; the replicas differ between the two by design
    (NOTE [Replica check before the step])."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank = dist.get_rank()
    old, replica_check.REPLICA_CHECK_TIMEOUT_S = replica_check.REPLICA_CHECK_TIMEOUT_S, 5.0
    with ddp_patches.patched(on_unsynced="raise", replica_check_every=1), _Capture() as cap:
        torch.manual_seed(0)
        ddp = _ddp(nn.Linear(8, 1, bias=False) if one_tensor else _mlp())  # one tensor: rank 1's shard is empty
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        for it in range(steps):
            ddp(_batch(rank, it)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        in_sync = _in_sync(ddp.module)
    replica_check.REPLICA_CHECK_TIMEOUT_S = old
    return {"all": cap.records, "in_sync": in_sync}


@pytest.mark.parametrize("one_tensor", [False, True], ids=["shards-on-both-ranks", "one-rank-shard-empty"])
def test_zero_redundancy_optimizer_is_silent(pool, one_tensor):
    for r in pool.run(zero_redundancy, one_tensor=one_tensor):
        assert r["all"] == [] and r["in_sync"], r["all"]


def elastic_attempts_case() -> dict:
    """What torchrun --max-restarts does to the guard's store keys: the launcher's store outlives the attempt, and
    the new attempt's processes count their DDPs and steps from zero again. Attempt 0 trains two checked steps
    with some weights; attempt 1 (a resumed run: other weights) checks its first step while rank 0 is slow to
    publish. Rank 1 must wait for attempt 1's fingerprint, not read attempt 0's (a false "drifted apart")."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank()
    errors = []
    saved = {k: os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")}
    try:
        for attempt in range(2):
            os.environ.update(TORCHELASTIC_RUN_ID="elastic-test", TORCHELASTIC_RESTART_COUNT=str(attempt))
            guard._group_counters.clear()  # a new process of the new attempt counts its DDPs from zero
            with ddp_patches.patched(on_unsynced="raise", replica_check_every=1), _Capture() as cap:
                torch.manual_seed(100 + attempt)
                ddp = _ddp(_mlp())
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
                for it in range(2):
                    ddp(_batch(rank, it)).pow(2).mean().backward()
                    if rank == 0 and attempt == 1 and it == 0:
                        time.sleep(1.0)  # rank 1 reaches the check first and reads the store
                    try:
                        opt.step()
                    except replica_check.ReplicaDivergenceError as exc:
                        errors.append(str(exc))
                    opt.zero_grad()
                errors += cap.lines(DIVERGED)
                in_sync = _in_sync(ddp.module)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"errors": errors, "in_sync": in_sync}


def test_an_elastic_restart_does_not_read_the_previous_attempts_fingerprints(pool):
    for r in pool.run(elastic_attempts_case):
        assert r["in_sync"] and r["errors"] == [], r


def hand_averaged(on_unsynced: str, steps: int = 3, drop_average_at: int | None = None) -> dict:
    """Micro-steps under ``no_sync()``, then the gradients averaged by hand (``dist.all_reduce(p.grad)``, divided by
    the world size) before each step: correct, so the guard stays silent (NOTE [Confirmed before it speaks]); from
    step ``drop_average_at`` on the averaging is left out, and the guard must speak then."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    with ddp_patches.patched(on_unsynced=on_unsynced, replica_check_every=0), _Capture() as cap:
        torch.manual_seed(0)
        ddp = _ddp(_mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        try:
            for it in range(steps):
                cap.step = it + 1
                with ddp.no_sync():
                    for micro in range(2):
                        (ddp(_batch(rank, it, micro)).pow(2).mean() / 2).backward()
                if drop_average_at is None or it + 1 < drop_average_at:
                    for p in ddp.parameters():
                        dist.all_reduce(p.grad)
                        p.grad /= world
                opt.step()
                opt.zero_grad()
        except guard.UnsynchronizedGradientsError as exc:
            error = str(exc)
        in_sync = _in_sync(ddp.module)
    return {"unsynced": cap.lines(UNSYNCED), "all": cap.records, "error": error, "in_sync": in_sync}


@pytest.mark.parametrize("on_unsynced", ["warn", "raise"])
def test_hand_averaged_gradients_are_silent(pool, on_unsynced):
    """Used to give the "never averaged" WARNING on every rank (and to crash a correct run under "raise") while
    the replicas were equal."""
    for r in pool.run(hand_averaged, on_unsynced=on_unsynced):
        assert r["error"] is None and r["unsynced"] == [] and r["in_sync"], r["all"]


def test_hand_averaging_left_out_later_is_reported(pool):
    for rank, r in enumerate(pool.run(hand_averaged, on_unsynced="warn", steps=4, drop_average_at=2)):
        assert [s for s, _, _ in r["unsynced"]] == [2] and f"rank {rank}:" in r["unsynced"][0][2], r["all"]
        assert not r["in_sync"]


# -- three ranks: the store waits of the unsynchronised-gradient guard have a partner that will come -----------------
@pytest.fixture(scope="module")
def pool3():
    """Three gloo ranks (rank 0 compares gradients with rank 1, rank 2 with rank 0), for this module's tests."""
    from tests.harness import DistPool

    p = DistPool(world_size=3)
    yield p
    p.close()


def module_loss_two_equal(library: bool, steps: int = 3, timeout_s: float = 5.0) -> dict:
    """A loss through ``.module`` on 3 ranks where ranks 0 and 2 see the same batches: their gradients are equal,
    rank 1's differ. Rank 0 and rank 1 warn at the first step; rank 2 (equal to rank 0) stays silent and checks
    again before step 2. What was logged, and how long the loop took."""
    import contextlib

    import torch.distributed as dist

    rank = dist.get_rank()
    data = 0 if rank == 2 else rank
    old, replica_check.REPLICA_CHECK_TIMEOUT_S = replica_check.REPLICA_CHECK_TIMEOUT_S, timeout_s
    try:
        with (ddp_patches.patched(on_unsynced="warn") if library else contextlib.nullcontext()), _Capture() as cap:
            torch.manual_seed(0)
            ddp = _ddp(_mlp())
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            start = time.perf_counter()
            for it in range(steps):
                cap.step = it + 1
                ddp.module(_batch(data, it)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            elapsed = time.perf_counter() - start
            in_sync = _in_sync(ddp.module)
    finally:
        replica_check.REPLICA_CHECK_TIMEOUT_S = old
    return {"elapsed": elapsed, "all": cap.records, "unsynced": cap.lines(UNSYNCED), "diverged": cap.lines(DIVERGED),
            "in_sync": in_sync}


def test_three_ranks_two_with_equal_gradients_do_not_wait_for_a_rank_that_warned(pool3):
    """Unpatched: trains (drifting: rank 1 differs), about 0.01 s on 3 CPU ranks. Patched, before the store waits
    had a rule: rank 0 stopped writing its gradients once it had warned, and rank 2 waited for them before step 2
    until the timeout (5 s here, 60 s by default)."""
    unpatched = pool3.run(module_loss_two_equal, library=False, timeout=60)
    assert all(r["all"] == [] and not r["in_sync"] for r in unpatched)
    assert max(r["elapsed"] for r in unpatched) < 2.0, [r["elapsed"] for r in unpatched]
    rank0, rank1, rank2 = pool3.run(module_loss_two_equal, library=True, timeout=60)
    for rank, r in ((0, rank0), (1, rank1)):
        assert [s for s, _, _ in r["unsynced"]] == [1] and f"rank {rank}:" in r["unsynced"][0][2], r["all"]
    assert rank2["all"] == [], rank2["all"]  # equal to rank 0: nothing to say, and no skipped comparison
    # the replica check before step 2 sees rank 1's drift, on rank 1 or rank 0 (the later of the two)
    assert {s for s, _, _ in rank0["diverged"] + rank1["diverged"]} == {2}, (rank0["all"], rank1["all"])
    assert rank0["all"] == rank0["unsynced"] + rank0["diverged"] and "rank 2" not in str(rank0["diverged"])
    assert max(r["elapsed"] for r in (rank0, rank1, rank2)) < 2.0, [r["elapsed"] for r in (rank0, rank1, rank2)]


# -- the step check's cached view of an optimizer (NOTE [The step check without a walk per step]) ---------------------
def group_added_then_module_loss() -> dict:
    """The optimizer holds layer 0 only for step 1, gets layer 2 by ``add_param_group``, steps 2 through the wrapper,
    then step 3 applies gradients of layer 2 alone from a loss through ``.module[2]`` (never averaged)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    with ddp_patches.patched(on_unsynced="warn", replica_check_every=1), _Capture() as cap:
        torch.manual_seed(0)
        ddp = _ddp(_mlp())
        opt = torch.optim.SGD(ddp.module[0].parameters(), lr=0.1)
        for it in range(3):
            cap.step = it + 1
            if it == 1:
                ddp.module[2].zero_grad(set_to_none=True)
                opt.add_param_group({"params": list(ddp.module[2].parameters())})
            if it < 2:
                ddp(_batch(rank, it)).pow(2).mean().backward()
            else:
                hidden = torch.tanh(ddp.module[0](_batch(rank, it))).detach()
                ddp.module[2](hidden).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return {"unsynced": cap.lines(UNSYNCED), "all": cap.records}


def test_a_parameter_group_added_later_is_checked(pool):
    """With a view of the optimizer kept from step 1, layer 2's gradients were not the optimizer's: no warning. The
    step follows no synchronised backward, so a rank compares only a record already there: at least one of the
    two does (each writes before it reads)."""
    results = pool.run(group_added_then_module_loss)
    lines = [line for r in results for line in r["unsynced"]]
    assert lines and all(s == 3 and "'2.weight'" in m for s, _, m in lines), [r["all"] for r in results]
    assert all(r["all"] == r["unsynced"] for r in results)
