"""apply(chunked_loss=True): the LM loss from the final hidden states in chunks, exact against transformers' own
loss in one process and under DDP (raw DDP, HF Trainer with accumulation and num_items_in_batch), stepping aside
where the logits are read or transformed, and never holding the full float32 logits."""

from __future__ import annotations

import logging

import pytest
import torch

import ddp_patches
from ddp_patches import chunked_loss
from ddp_patches.verify.hf_models import build_causal_lm, tiny_config

VOCAB = 64


def _batch(seed: int, rows: int = 2, seq: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt, and padding: the mean over tokens differs from the mean over rows
    labels[-1, -3:] = -100
    return {"input_ids": ids, "labels": labels}


def _grads(model, batch: dict, *, scale: float = 1.0, **kwargs) -> tuple[torch.Tensor, dict]:
    """The output, and each parameter's gradient of its loss times ``scale`` (a loss scaler's)."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    (out.loss * scale).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _as_under_ddp():
    """apply(chunked_loss=True), this process's models taken as run by DDP (engines.acting_as): the single-process
    checks of the arithmetic; in a plain single process nothing changes (test_one_process_changes_nothing)."""
    from contextlib import ExitStack

    from ddp_patches import engines

    stack = ExitStack()
    stack.enter_context(ddp_patches.patched(chunked_loss=True))
    stack.enter_context(engines.acting_as(engines.DDP))
    return stack


def test_one_process_changes_nothing():
    torch.manual_seed(0)
    model = build_causal_lm("llama", dtype=torch.float64)
    batch = _batch(3)
    ref_out, ref = _grads(model, batch)
    with ddp_patches.patched(chunked_loss=True):
        out, got = _grads(model, batch)
    assert out.logits is not None and chunked_loss.counts()["chunked_calls"] == 0
    assert torch.equal(out.loss, ref_out.loss) and all(torch.equal(got[n], ref[n]) for n in ref)


def _rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-30)).item() for n in a)


def _lora_lm(lm_head: bool):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = build_causal_lm("llama", dtype=torch.float64)
    targets = ["q_proj", "v_proj"] + (["lm_head"] if lm_head else [])
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))


@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": torch.tensor(9)}, "shift_labels"],
                         ids=["mean", "num_items_in_batch", "shift_labels"])
@pytest.mark.parametrize("lm_head", [False, True], ids=["lora", "lora-on-lm_head"])
def test_lora_on_lm_head_gradients_and_one_hook_each(kwargs, lm_head):
    batch = _batch(1)
    if kwargs == "shift_labels":
        kwargs = {"shift_labels": torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()}
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    ref_out, ref = _grads(_lora_lm(lm_head), batch, **kwargs)
    with _as_under_ddp(), chunked_loss.chunk_rows(5):
        model = _lora_lm(lm_head)
        fired: dict[str, int] = {}
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
        out, got = _grads(model, batch, **kwargs)
        assert chunked_loss.counts() == {"chunked_calls": 1, "chunks": 5}  # 24 tokens in chunks of at most 5
    assert out.logits is None
    assert torch.allclose(out.loss, ref_out.loss, rtol=1e-6, atol=0)  # transformers upcasts logits to float32
    assert _rel(got, ref) < 1e-6
    assert set(fired.values()) == {1} and len(fired) == len(got)
    assert any("lm_head" in n for n in got) == lm_head


def test_a_retained_graph_backpropagates_twice():
    batch = _batch(7)
    ref_model = _lora_lm(True).train()
    ref_model(**batch).loss.backward()
    ref = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
    with _as_under_ddp(), chunked_loss.chunk_rows(5):
        model = _lora_lm(True).train()
        loss = model(**batch).loss
        (loss * 0.5).backward(retain_graph=True)
        (loss * 0.5).backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert _rel(got, ref) < 1e-6


def test_single_process_eval_and_no_labels_are_untouched():
    torch.manual_seed(0)
    model = build_causal_lm("llama")
    batch = _batch(2)
    with _as_under_ddp():
        model.eval()
        assert model(**batch).logits.shape == (2, 12, VOCAB)
        model.train()
        assert model(input_ids=batch["input_ids"]).logits.shape == (2, 12, VOCAB)
        with torch.no_grad():
            assert model(**batch).logits is not None
        assert chunked_loss.counts()["chunked_calls"] == 0
        assert model(**batch).logits is None
    assert model(**batch).logits is not None  # reverted


def _edits_logits_class():
    from transformers import LlamaForCausalLM

    class EditsLogits(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden) * 0.5
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=VOCAB, **kwargs)
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return CausalLMOutputWithPast(loss=loss, logits=logits)

    return EditsLogits


def test_a_forward_that_edits_the_logits_runs_unchunked(caplog):
    from transformers import AutoModelForCausalLM

    cls = _edits_logits_class()
    batch = _batch(3)
    torch.manual_seed(0)
    ref_out, ref = _grads(cls(tiny_config("llama")).double(), batch)
    gemma_config = tiny_config("llama").to_dict() | {"model_type": "gemma2", "head_dim": 8}
    from transformers import Gemma2Config

    with caplog.at_level(logging.INFO, logger="ddp_patches"), _as_under_ddp():
        torch.manual_seed(0)
        model = cls(tiny_config("llama")).double()
        for _ in range(2):  # the second call no longer tries
            out, got = _grads(model, batch)
            assert out.logits is not None and _rel(got, ref) < 1e-12
        gemma = AutoModelForCausalLM.from_config(Gemma2Config(**{k: v for k, v in gemma_config.items()
                                                                  if k != "model_type"}))
        assert gemma.config.final_logit_softcapping is not None
        assert _grads(gemma, batch)[0].logits is not None
        assert chunked_loss.counts()["chunked_calls"] == 0
    lines = [r.getMessage() for r in caplog.records if "chunked loss steps aside" in r.getMessage()]
    assert any("uses the logits other than as the loss's input (mul)" in line for line in lines), lines
    assert any("final_logit_softcapping" in line for line in lines), lines
    assert len(lines) == 2


def compute_loss(model, batch):  # a Trainer subclass's compute_loss that reads the logits, as TRL's once did
    outputs = model(**batch)
    return outputs.loss, outputs.logits.argmax(-1)


class _AccuracyTrainer:  # a compute_loss that never names the logits: a helper of its class reads them
    def compute_loss(self, model, inputs):
        outputs = model(**inputs)
        return outputs.loss, self.token_accuracy(outputs, inputs["labels"])

    def token_accuracy(self, outputs, labels):
        return (outputs.logits[:, :-1].argmax(-1) == labels[:, 1:]).float().mean()


class _SmoothingTrainer:  # what Trainer.compute_loss does with label smoothing: the labels are taken out
    label_smoother = object()

    def compute_loss(self, model, inputs):
        inputs = dict(inputs)
        inputs.pop("labels")
        return model(**inputs).logits


def test_steps_aside_where_logits_are_read(caplog):
    torch.manual_seed(0)
    model = build_causal_lm("llama")
    with caplog.at_level(logging.INFO, logger="ddp_patches"), _as_under_ddp():
        model.train()
        loss, predictions = compute_loss(model, _batch(4))
        assert predictions.shape == (2, 12) and chunked_loss.counts()["chunked_calls"] == 0
        model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().logsumexp(-1).mean()
        assert model(**_batch(4)).logits is not None and chunked_loss.counts()["chunked_calls"] == 0
        for _ in range(2):
            assert _SmoothingTrainer().compute_loss(model, _batch(4)).shape == (2, 12, VOCAB)
        model = build_causal_lm("llama").train()  # transformers' own loss_function again
        loss, accuracy = _AccuracyTrainer().compute_loss(model, _batch(4))
        assert accuracy.shape == () and chunked_loss.counts()["chunked_calls"] == 0
    lines = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(lines) == 4 and "compute_loss is not transformers' and may read the logits" in lines[0], lines
    assert "not transformers' ForCausalLMLoss" in lines[1], lines
    assert "_SmoothingTrainer computes the loss from the logits itself (label smoothing)" in lines[2], lines
    assert "_AccuracyTrainer.compute_loss is not transformers'" in lines[3], lines


def test_a_trainer_keeping_an_output_by_position_runs_unchunked(caplog, tmp_path):
    """transformers' Trainer.compute_loss (before 5.0) keeps ``outputs[args.past_index]``: logits None would shift
    that position, so a Trainer with past_index >= 0 computes the logits. NOTE [When the chunked loss acts]"""
    import os

    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = build_causal_lm("llama").train()
    environ = dict(os.environ)
    try:
        trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
        with caplog.at_level(logging.INFO, logger="ddp_patches"), _as_under_ddp():
            trainer.args.past_index = 0
            trainer.compute_loss(model, _batch(4))
            assert chunked_loss.counts()["chunked_calls"] == 0
            trainer.args.past_index = -1
            trainer.compute_loss(model, _batch(4))
            assert chunked_loss.counts()["chunked_calls"] == 1
    finally:  # the Trainer's process-wide state, as single_process_trainer_grads leaves it
        os.environ.clear()
        os.environ.update(environ)
        AcceleratorState._reset_state()
        GradientState._reset_state()
    lines = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(lines) == 1 and "past_index keeps an output by position" in lines[0], lines


@pytest.mark.parametrize("engine", ["FSDP1", "DeepSpeed"])
def test_other_engines_step_aside_with_one_warning(caplog, engine):
    from ddp_patches import engines

    torch.manual_seed(0)
    model = build_causal_lm("llama").train()
    with caplog.at_level(logging.INFO, logger="ddp_patches"), ddp_patches.patched(chunked_loss=True), \
            engines.acting_as(engine):
        for _ in range(2):
            assert model(**_batch(6)).logits is not None
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "the chunked LM loss" in lines[0] and engine in lines[0], lines


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_vlm_language_model_chunks(family):
    from ddp_patches.verify.vlm_models import build_vlm, vlm_batch

    batch = vlm_batch(family, 0, 0, 0)
    torch.manual_seed(0)
    ref_out, ref = _grads(build_vlm(family, dtype=torch.float64), batch)
    with _as_under_ddp(), chunked_loss.chunk_rows(7):
        torch.manual_seed(0)
        out, got = _grads(build_vlm(family, dtype=torch.float64), batch)
        assert chunked_loss.counts()["chunked_calls"] == 1
    assert out.logits is None and torch.allclose(out.loss, ref_out.loss, rtol=1e-6, atol=0)
    assert _rel(got, ref) < 1e-6


def test_chunk_rule_and_peak_bytes():
    # NOTE [Chunks by shapes]: Llama-3.1-8B at 64K tokens, 32 chunks of 2048 tokens
    assert chunked_loss.chunk_sizes(65536, 4096, 128256) == [2048] * 32
    assert chunked_loss.chunk_sizes(7, 32, 64, 3) == [3, 2, 2]
    rows, hidden, vocab = 512, 16, 2048
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(1, rows, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (1, rows))
    full_fp32 = rows * vocab * 4
    from transformers.loss.loss_utils import ForCausalLMLoss

    from tools.chunked_loss_bytes import LiveBytes as _PeakBytes  # the tool's counter: the largest tensor, the peak

    with _PeakBytes() as unchunked:
        ForCausalLMLoss(head(h), labels, vocab).backward()
    with _PeakBytes() as chunked:
        head_fn = chunked_loss.function._Head(head, head.forward)
        chunked_loss.chunked_causal_lm_loss(head_fn, h, labels, (head.weight,)).backward()
    assert unchunked.largest >= full_fp32
    assert chunked.largest < full_fp32 / 8  # 128 chunks of 4 tokens: no [tokens, V] tensor at all
    assert chunked.peak < unchunked.peak / 2


# -- DDP ------------------------------------------------------------------------------------------------------------
def _padded_lm_batch(rank: int, it: int, micro: int) -> dict:
    batch = _batch(10_000 * rank + 100 * it + micro)
    batch["labels"][0, :(rank + it) % 4 + 1] = -100  # other positions per rank, the same count in each row pair
    batch["labels"][1, -((rank + it) % 4 + 1):] = -100
    batch["labels"][0, -4:] = -100
    return batch


def raw_ddp_case(lm_head: bool, ddp_kwargs: dict) -> dict:
    from ddp_patches.verify.hf_models import lm_parity

    with _as_under_ddp(), chunked_loss.chunk_rows(5):
        result = lm_parity("llama", {"use_reentrant": True}, ddp_kwargs=ddp_kwargs, accum=2, iters=2,
                           reference_context=chunked_loss.unchunked, build=lambda: _lora_lm(lm_head),
                           batch=_padded_lm_batch)
        return {**result.as_dict(), "counts": chunked_loss.counts()}


@pytest.mark.parametrize("lm_head,ddp_kwargs", [(True, {}), (True, {"static_graph": True}),
                                                (False, {"find_unused_parameters": True})],
                         ids=["lora-on-lm_head", "static-graph", "find-unused"])
def test_raw_ddp_parity(pool, lm_head, ddp_kwargs):
    for r in pool.run(raw_ddp_case, lm_head=lm_head, ddp_kwargs=ddp_kwargs):
        assert r["iterations"] == 2 and r["ranks_in_sync"]
        assert r["max_rel_error"] < 1e-6, r
        assert r["counts"]["chunked_calls"] == 4  # the reference's calls ran unchunked


def _recorder(grads: list):
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append([p.grad.double().sum().item() for p in model.parameters() if p.requires_grad])

    return Record()


def _trainer_setup(ckpt_kwargs, grads: list):
    """A LoRA Llama and 16 rows whose labels ignore 0-6 leading tokens (num_items_in_batch differs per batch)."""
    from datasets import Dataset

    from ddp_patches.verify.hf_models import build_lora_model

    torch.manual_seed(0)
    model = build_lora_model("llama", ckpt_kwargs, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (16, 12), generator=g)
    labels = ids.clone()
    for i in range(16):
        labels[i, : i % 7] = -100
    return model, Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()}), \
        {"callbacks": [_recorder(grads)]}


def trainer_case(kind: str, chunked: bool) -> dict:
    """HF Trainer (gradient_accumulation_steps=2, num_items_in_batch over padded labels) or TRL's SFTTrainer on
    2 ranks; the gradients of every optimizer step, as each rank holds them after the all-reduce."""
    from ddp_patches.verify import trainer_runs

    grads: list[list[float]] = []

    def setup(ckpt_kwargs, text_only=False):
        return _trainer_setup(ckpt_kwargs, grads)

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("ddp_patches")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with ddp_patches.patched(chunked_loss=chunked), chunked_loss.chunk_rows(5):
            result = trainer_runs.train(kind, ckpt_kwargs={"use_reentrant": True}, accum=2, steps=2, setup=setup)
            return {**result, "grads": grads, "counts": chunked_loss.counts(),
                    "lines": [line for line in lines if "chunked loss" in line]}
    finally:
        log.removeHandler(handler)


def single_process_trainer_grads() -> list:
    """The reference: one process, the global batch (4 rows per micro-step, accumulation 2), the unchunked loss.
    accelerate deals a shuffled order's batches of 2 to the ranks in turn, so each global micro-batch is the
    single process's batch of 4."""
    import os
    import tempfile

    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    grads: list[list[float]] = []
    model, dataset, extra = _trainer_setup({"use_reentrant": True}, grads)
    environ = dict(os.environ)
    try:
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                     max_steps=2, learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
                                     gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True},
                                     dataloader_num_workers=0, disable_tqdm=True, seed=0, logging_steps=1)
            Trainer(model=model, args=args, train_dataset=dataset, **extra).train()
    finally:
        os.environ.clear()
        os.environ.update(environ)
        AcceleratorState._reset_state()
        GradientState._reset_state()
    return grads


@pytest.mark.slow
def test_trainer_matches_a_single_process_reference(pool):
    chunked = pool.run(trainer_case, kind="trainer", chunked=True)
    reference = single_process_trainer_grads()
    assert len(reference) == 2
    for c in chunked:  # 2 ranks x 2 steps x 2 micro-steps, each rank's gradients after the all-reduce
        assert c["counts"]["chunked_calls"] == 4 and c["steps"] == 2 and c["lora_in_sync"]
        for gc, gr in zip(c["grads"], reference):
            assert gc == pytest.approx(gr, rel=1e-4, abs=1e-6)
    lines = [line for line in chunked[0]["lines"] if " found (" not in line]  # a class imported after apply()
    assert len(lines) == 1 and "computes its training loss in chunks" in lines[0], lines
    assert chunked[1]["lines"] == []  # rank 0 only


@pytest.mark.slow
def test_sft_trainer_is_not_reached_and_trains_as_without(pool):
    # TRL's SFTTrainer runs its own fused LM head, which calls the backbone and never the model's forward with
    # labels: not reached, one INFO line, the gradients of a run without the option.
    chunked = pool.run(trainer_case, kind="sft", chunked=True)
    plain = pool.run(trainer_case, kind="sft", chunked=False)
    for c, p in zip(chunked, plain):
        assert c["steps"] == 2 and c["lora_in_sync"] and c["counts"]["chunked_calls"] == 0
        assert c["grads"] == p["grads"] and len(c["grads"]) == 2
    lines = [line for line in chunked[0]["lines"] if " found (" not in line]  # a class imported after apply()
    assert len(lines) == 1 and "forward is replaced on the instance by trl/trainer/utils.py:_fused_forward" \
        in lines[0], lines
    assert chunked[1]["lines"] == []  # rank 0 only

def accuracy_trainer_case(chunked: bool, via: str) -> dict:
    """An HF Trainer subclass that logs a token accuracy from ``outputs.logits``: ``via`` "helper", its
    compute_loss takes super()'s outputs (``return_outputs=True``) and hands them to a helper method; "training_step",
    its training_step calls the model itself; "loss_only", its compute_loss takes super()'s loss alone and the
    accuracy is not logged. One optimizer step on 2 ranks: each rank's error, if any, its accuracies and the loss."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from ddp_patches.verify.hf_models import build_lora_model, lm_dataset

    def accuracy(outputs, labels):
        predictions, labels = outputs.logits[:, :-1].argmax(-1), labels[:, 1:]
        return float((predictions == labels)[labels != -100].float().mean())

    class AccuracyTrainer(Trainer):
        accuracies: list = []
        losses: list = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if via == "helper":
                loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                     num_items_in_batch=num_items_in_batch)
                self.token_accuracy(outputs, inputs["labels"])
                return (loss, outputs) if return_outputs else loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def token_accuracy(self, outputs, labels):
            self.accuracies.append(accuracy(outputs, labels))

        def training_step(self, model, inputs, num_items_in_batch=None):
            if via != "training_step":
                loss = super().training_step(model, inputs, num_items_in_batch)
            else:
                outputs = model(**inputs)
                self.token_accuracy(outputs, inputs["labels"])
                self.accelerator.backward(outputs.loss)
                loss = outputs.loss.detach()
            self.losses.append(float(loss))
            return loss

    with ddp_patches.patched(chunked_loss=chunked):
        torch.manual_seed(0)
        model = build_lora_model("llama", {"use_reentrant": False}, dtype=torch.float32)
        with tempfile.TemporaryDirectory(prefix="ddp_patches_chunked_") as out:
            args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1, save_strategy="no",
                                     report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                                     seed=0, gradient_checkpointing=True,
                                     gradient_checkpointing_kwargs={"use_reentrant": False})
            trainer = AccuracyTrainer(model=model, args=args, train_dataset=lm_dataset())
            try:
                trainer.train()
                error = None
            except Exception as e:  # returned, not raised: a rank's error would poison the pool
                error = f"{type(e).__name__}: {e}"
        return {"error": error, "accuracies": list(AccuracyTrainer.accuracies), "losses": list(AccuracyTrainer.losses),
                "counts": chunked_loss.counts()}


def test_a_trainer_whose_own_code_reads_logits_trains_as_without(pool):
    """Without the library each rank trains and logs an accuracy. The chunked loss once acted where the reading is
    in a helper method or a training_step override (the compute_loss never names ``logits``) and every rank died
    with "'NoneType' object is not subscriptable"; it steps aside there now, with the same accuracies and loss. Where
    the override takes super()'s loss alone, the outputs never leave transformers' compute_loss: it still acts.
    NOTE [When the chunked loss acts]"""
    plain = pool.run(accuracy_trainer_case, chunked=False, via="helper")
    for via in ("helper", "training_step"):
        for p, c in zip(plain, pool.run(accuracy_trainer_case, chunked=True, via=via)):
            assert p["error"] is None and len(p["accuracies"]) == 1, p
            assert c["error"] is None and c["accuracies"] == p["accuracies"], (via, c)
            assert c["losses"] == p["losses"] and c["counts"]["chunked_calls"] == 0, (via, c)
    for p, c in zip(plain, pool.run(accuracy_trainer_case, chunked=True, via="loss_only")):
        assert c["error"] is None and c["counts"]["chunked_calls"] == 1, c
        assert c["losses"] == pytest.approx(p["losses"], rel=1e-5), c


def dpo_case(chunked: bool) -> dict:
    """TRL's DPOTrainer (LoRA, accumulation 2) on 2 ranks: the gradients of every optimizer step."""
    import torch.distributed as dist
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from ddp_patches.verify.hf_models import _barrier, _shared_tmpdir
    from tools.clients import build_datasets, build_model_dir

    grads: list[list[float]] = []

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append([p.grad.double().sum().item() for p in model.parameters() if p.requires_grad])

    with _shared_tmpdir() as root, ddp_patches.patched(chunked_loss=chunked), chunked_loss.chunk_rows(5):
        if dist.get_rank() == 0:
            build_model_dir(f"{root}/model")
            build_datasets(f"{root}/data", rows=8)
        _barrier()
        args = DPOConfig(output_dir=f"{root}/out", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=2, learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                         max_length=32, logging_steps=1, seed=0, dataloader_num_workers=0, disable_tqdm=True)
        torch.manual_seed(0)
        trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(f"{root}/model"), args=args,
                             train_dataset=Dataset.from_json(f"{root}/data/dpo/train.jsonl"),
                             processing_class=AutoTokenizer.from_pretrained(f"{root}/model"), callbacks=[Record()],
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"))
        trainer.train()
        _barrier()
        return {"grads": grads, "counts": chunked_loss.counts()}


@pytest.mark.slow
def test_dpo_trainer_is_not_reached_and_trains_as_without(pool):
    # DPO reads log-probs: TRL computes them with its own fused LM head (chunked), which never calls the model's
    # forward with labels; the chunked loss is not reached and the gradients are those of a run without it.
    chunked = pool.run(dpo_case, chunked=True)
    plain = pool.run(dpo_case, chunked=False)
    for c, p in zip(chunked, plain):
        assert c["counts"]["chunked_calls"] == 0 and len(c["grads"]) == 2
        assert c["grads"] == p["grads"]


def accelerate_case() -> dict:
    """accelerate's Accelerator(cpu=True).prepare (DDP) against a single-process replica on the global batch."""
    from accelerate import Accelerator

    from ddp_patches.verify.hf_models import lm_parity

    with ddp_patches.patched(chunked_loss=True), chunked_loss.chunk_rows(5):
        accelerator = Accelerator(cpu=True)
        result = lm_parity("llama", {"use_reentrant": True}, accum=2, iters=2, reference_context=chunked_loss.unchunked,
                           build=lambda: _lora_lm(True), batch=_padded_lm_batch,
                           wrap=lambda model, **kwargs: accelerator.prepare(model))
        return {**result.as_dict(), "counts": chunked_loss.counts()}


def test_accelerate_parity(pool):
    for r in pool.run(accelerate_case):
        assert r["iterations"] == 2 and r["ranks_in_sync"] and r["max_rel_error"] < 1e-6, r
        assert r["counts"]["chunked_calls"] == 4


def test_tied_embeddings_full_training_one_hook_each():
    from transformers import AutoModelForCausalLM

    def build():
        torch.manual_seed(0)
        config = tiny_config("llama")
        config.tie_word_embeddings = True
        return AutoModelForCausalLM.from_config(config).double()

    batch = _batch(5)
    ref_out, ref = _grads(build(), batch)
    with _as_under_ddp(), chunked_loss.chunk_rows(7):
        model = build()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        fired: dict[str, int] = {}
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
        out, got = _grads(model, batch)
    assert out.logits is None and _rel(got, ref) < 1e-6
    assert set(fired.values()) == {1} and len(fired) == len(got)


def test_a_batch_without_tokens_gives_zero_gradients_as_transformers():
    """Every label ignore_index (one rank's share of a padded batch): the loss is nan as transformers' (0/0), and
    the gradients are zero, not NaN, as cross_entropy gives ignored rows: DDP's average stays finite."""
    batch = _batch(8)
    batch["labels"][:] = -100
    ref_out, ref = _grads(_lora_lm(True), batch)
    with _as_under_ddp():
        out, got = _grads(_lora_lm(True), batch)
    assert out.logits is None and torch.isnan(out.loss) and torch.isnan(ref_out.loss)
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)


def fsdp2_case(lm_head: bool) -> dict:
    from ddp_patches.verify.fsdp2 import run_fsdp2_parity
    from ddp_patches.verify.hf_models import combine_lm, lm_loss

    with ddp_patches.patched(chunked_loss=True), chunked_loss.chunk_rows(5):
        result = run_fsdp2_parity(lambda: _lora_lm(lm_head), _padded_lm_batch, combine_lm, lm_loss, accum=2,
                                  iters=2, reference_context=chunked_loss.unchunked)
        return {**result.as_dict(), "counts": chunked_loss.counts()}


@pytest.mark.parametrize("lm_head", [True, False], ids=["lora-on-lm_head", "frozen-lm_head"])
def test_fsdp2_parity(pool, lm_head):
    """FSDP2 (``fully_shard`` per decoder layer + root, the LM head in the root's group), 2 ranks with different
    data and padding, accumulation 2, against a single process on the global batch, unchunked."""
    for r in pool.run(fsdp2_case, lm_head=lm_head):
        assert r["iterations"] == 2 and r["ranks_in_sync"]
        assert r["max_rel_error"] < 1e-6, r
        assert r["counts"]["chunked_calls"] == 4, r


def test_a_half_precision_head_sums_its_gradient_in_float32():
    """A trained bf16 lm_head in 128 chunks: its gradient is as close to the float64 one as the unchunked loss's
    (whose matmul accumulates over all tokens in float32); summed in bf16 chunk by chunk it was 3.5 times further
    (NOTE [One gradient per parameter, computed in forward])."""
    torch.manual_seed(0)
    model = build_causal_lm("llama", dtype=torch.bfloat16).train()
    exact_model = build_causal_lm("llama", dtype=torch.float64).train()
    exact_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ids = torch.randint(1, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    exact = _grads(exact_model, batch)[1]["lm_head.weight"]
    unchunked = _grads(model, batch)[1]["lm_head.weight"].double()
    with _as_under_ddp(), chunked_loss.chunk_rows(2):
        chunked = _grads(model, batch)[1]["lm_head.weight"].double()
        assert chunked_loss.counts()["chunks"] == 128
    error = {name: float((g - exact).norm() / exact.norm()) for name, g in (("un", unchunked), ("ch", chunked))}
    assert error["ch"] <= 1.5 * error["un"], error


def _fsdp2_fp16_head_grad(patched: bool, tokens: int = 4096) -> dict:
    """A tiny Llama (float32, full fine-tuning) under FSDP2 with ``MixedPrecisionPolicy(param_dtype=float16,
    reduce_dtype=float32)``; each rank's batch is ``tokens`` copies of one token (another per rank) and the final
    norm's weight is 8, so that lm_head's gradient of the loss SUM passes float16's 65504 while that of the mean
    does not. Returns lm_head.weight's full gradient."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from ddp_patches.verify.fsdp2 import shard
    from ddp_patches.verify.hf_models import tiny_config
    from ddp_patches.verify.parity import full_tensor

    rank = torch.distributed.get_rank()
    with ddp_patches.patched(chunked_loss=patched):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", 2), attn_implementation="eager").float()
        with torch.no_grad():
            model.model.norm.weight.fill_(8.0)
        shard(model.train(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
        ids = torch.full((2, tokens // 2), 5 + rank)
        model(input_ids=ids, labels=ids).loss.backward()
        grad = full_tensor(model.lm_head.weight.grad).double()
        return {"grad": grad, "calls": chunked_loss.counts()["chunked_calls"]}


def fsdp2_float16_case() -> dict:
    plain, chunked = _fsdp2_fp16_head_grad(False), _fsdp2_fp16_head_grad(True)
    g, ref = chunked["grad"], plain["grad"]
    return {"plain_finite": bool(ref.isfinite().all()), "chunked_finite": bool(g.isfinite().all()),
            "rel": float((g - ref).norm() / ref.norm()), "calls": chunked["calls"]}


def test_fsdp2_float16_compute_head_gradient_as_unchunked(pool):
    """Found by review: FSDP2 computing in float16, 4096 tokens a rank: without the library lm_head's gradient is
    finite; the chunked loss added the chunks' gradients of the loss sum in float16 (up to tokens x |h|) and got
    inf. They are now added in float32 and scaled by the incoming gradient before the cast back."""
    for r in pool.run(fsdp2_float16_case):
        assert r["calls"] == 1 and r["plain_finite"], r
        assert r["chunked_finite"] and r["rel"] < 1e-2, r


def _grads_scaled(model, batch: dict, scale: float) -> dict:
    """``_grads`` of the loss times ``scale``, in float64."""
    return {n: g.double() for n, g in _grads(model, batch, scale=scale)[1].items()}


@pytest.mark.parametrize("lm_head", [True, False], ids=["lora-on-lm_head", "frozen-lm_head"])
def test_float16_loss_scaled_by_65536_keeps_gradients_finite(lm_head):
    """Found by review (of a version that divided inside the chunks): a float16 model whose loss is scaled by 2**16
    (GradScaler's and DeepSpeed fp16's initial scale): unchunked every gradient is finite, and so it is chunked."""
    batch = _batch(1)
    ref = _grads_scaled(_lora_lm(lm_head).half(), batch, 65536.0)
    with _as_under_ddp():
        got = _grads_scaled(_lora_lm(lm_head).half(), batch, 65536.0)
        assert chunked_loss.counts()["chunked_calls"] == 1
    assert all(torch.isfinite(g).all() for g in ref.values())
    assert not sorted(n for n, g in got.items() if not torch.isfinite(g).all())


def test_float16_autocast_with_a_grad_scaler_scale_as_unchunked():
    """The HF Trainer's fp16=True path: a float32 LoRA model under float16 autocast, the loss scaled by 65536,
    2048 tokens: the LoRA gradients are as close to float64 chunked as unchunked (a version that took each chunk's
    gradients of the mean, the scale applied afterwards, was 3.1 times further: subnormal float16 logits' grads)."""
    ids = torch.randint(1, VOCAB, (4, 512), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    model, exact_model = _lora_lm(False).float(), _lora_lm(False)
    exact = _grads_scaled(exact_model, batch, 1.0)

    def error() -> float:
        with torch.autocast("cpu", dtype=torch.float16):
            grads = _grads_scaled(model, batch, 65536.0)
        return max(float((grads[n] / 65536.0 - exact[n]).norm() / exact[n].norm()) for n in exact
                   if exact[n].norm() > 0)

    unchunked = error()
    with _as_under_ddp():
        chunked = error()
        assert chunked_loss.counts()["chunked_calls"] == 1
    assert chunked <= 1.25 * unchunked, {"unchunked": unchunked, "chunked": chunked}
