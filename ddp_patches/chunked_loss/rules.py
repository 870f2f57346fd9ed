"""When the chunked loss acts, and the one line said where it steps aside (NOTE [When the chunked loss acts]).

``_why_not(model)`` gives the reason a call steps aside: another engine, a logit transform in the config, another
loss function, hooks or dropout on lm_head, outputs that reach a ``compute_loss`` or Trainer method not transformers'.
"""

from __future__ import annotations

import logging
import sys

import torch

from .. import engines
from ..distributed import log_rank0_once

# Where it acts: under DDP, FSDP2 and DeepSpeed ZeRO-1/2, as the tiled MLP (``engines.ACTS_UNDER``; in one process
# the library changes nothing); other engines step aside with one WARNING, a single process silently.

# Config attributes of models whose forward changes the logits between lm_head and the loss (Gemma-2's softcap,
# Cohere's and Granite's scales, ...), as TRL's own fused head reads them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                     "output_multiplier")


# NOTE [When the chunked loss acts]
# Invariant: the chunked loss replaces only a computation whose result is the loss alone. Rule: a call of a causal
# LM found by structure acts when apply(chunked_loss=True), under DDP (in one process nothing changes), in training
# with grad enabled and ``labels`` passed, its ``loss_function`` transformers' ForCausalLMLoss, no logit transform
# in its config, no hooks, instance forward or active dropout on lm_head, and the outputs reach no ``compute_loss``
# but transformers' nor a Trainer subclass's own method (it may hand them to code that reads ``logits``: no look at
# it can rule that out; transformers' compute_loss passes on only the loss unless asked for ``return_outputs``).
# Then ``logits`` is None (said once at INFO: a hand-written loop that reads them gets None); each step-aside is
# one line on rank 0, once per reason. Where labels are not passed (Trainer's label smoothing, ``compute_loss_func``)
# it is not reached: one INFO line; nor where TRL (SFT, DPO: its fused LM head) or Liger replaced the model's
# forward and chunk themselves: one INFO line when DDP wraps such a model (``note_fused``).
# Test: tests/test_chunked_loss.py::test_steps_aside_where_logits_are_read.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.2
def _step_aside(key: str, level: int, why: str) -> None:
    log_rank0_once(f"chunked-{key}", level, "ddp_patches: chunked loss steps aside: %s (%s)", why, _SEE)


_SEE = "NOTE [When the chunked loss acts] in ddp_patches/chunked_loss/rules.py"


def _config_problem(model: torch.nn.Module) -> str | None:
    """A logit transform the config declares (read per instance: one class, configs with and without)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [a for a in _LOGIT_TRANSFORMS if getattr(text, a, None) not in (None, 1, 1.0)]
    return f"{type(model).__qualname__} changes its logits before the loss ({found[0]} in its config)" \
        if found else None


def _loss_problem(model: torch.nn.Module) -> str | None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss = vars(model).get("_loss_function")
    if loss is None:
        loss_type = getattr(model, "loss_type", None)
        from transformers.loss.loss_utils import LOSS_MAPPING

        loss = LOSS_MAPPING.get(loss_type or "ForCausalLM", ForCausalLMLoss)
    if loss is not ForCausalLMLoss:
        return f"{type(model).__qualname__}'s loss_function is {getattr(loss, '__qualname__', loss)!r}, not " \
               "transformers' ForCausalLMLoss"
    return None


def _head_problem(head: torch.nn.Module) -> str | None:
    from torch.nn.modules import module as module_mod

    if "forward" in vars(head):
        return "its lm_head has an instance forward (accelerate's device hooks, another library's patch)"
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(module_mod, name, None):
            return f"a global module hook is set (torch.nn.modules.module.{name})"
    for sub in head.modules():
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks:
            return "its lm_head or a submodule of it has a forward or backward hook"
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training and sub.p > 0:
            return "its lm_head applies dropout (LoRA dropout on lm_head: chunks would draw other masks)"
    if any(p._backward_hooks for p in head.parameters() if p.requires_grad):
        return "a trainable lm_head parameter has a tensor hook"
    return None


def _outputs_may_be_read() -> str | None:
    """Why the outputs may reach code that reads the logits, from the stack, or None: a ``compute_loss`` other than
    transformers', or a method of a transformers ``Trainer`` subclass outside transformers (a ``training_step``
    override calling the model), which may read them itself or in whatever it hands the outputs to. Above
    transformers' own ``Trainer.compute_loss`` only the loss leaves, unless it was asked for ``return_outputs``."""
    trainer = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return None
        code = frame.f_code
        if frame.f_globals.get("__name__", "").startswith("transformers."):
            if code.co_name == "compute_loss" and not frame.f_locals.get("return_outputs"):
                args = getattr(frame.f_locals.get("self"), "args", None)
                if getattr(args, "past_index", -1) >= 0:  # it keeps outputs[past_index]: a None shifts the index
                    return "TrainingArguments.past_index keeps an output by position, which logits None would shift"
                return None  # the outputs stay in transformers' compute_loss, which reads the loss alone
        else:
            owner = frame.f_locals.get("self")
            if code.co_name == "compute_loss" or (trainer is not None and _is_a(owner, trainer)):
                name = f"{type(owner).__qualname__}.{code.co_name}" if owner is not None else code.co_qualname
                return f"{name} is not transformers' and may read the logits (itself, or whatever it hands the " \
                       "outputs to)"
        frame = frame.f_back
    return None


def _is_a(owner, cls: type) -> bool:
    try:
        return isinstance(owner, cls)
    except Exception:  # an object whose __class__ raises (a proxy) is no Trainer
        return False


def _note_loss_outside() -> None:
    """One INFO line where a Trainer takes the labels out of the forward to compute the loss from the logits
    itself (label smoothing, ``compute_loss_func``): the chunked loss is not reached there."""
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return
        if frame.f_code.co_name == "compute_loss":
            owner = frame.f_locals.get("self")
            for attr, what in (("label_smoother", "label smoothing"), ("compute_loss_func", "compute_loss_func")):
                if getattr(owner, attr, None) is not None:
                    _step_aside(f"outside-{attr}", logging.INFO,
                                f"{type(owner).__qualname__} computes the loss from the logits itself ({what}): the "
                                "model's forward gets no labels, and the logits are built")
                    return
            return
        frame = frame.f_back


def _why_not(model: torch.nn.Module) -> tuple[str, int, str] | None:
    """(key, level, why) of a step-aside, else None. An engine outside ``engines.ACTS_UNDER`` says so itself
    (why: "")."""
    engine = engines.of_module(model)
    if not engines.acts("chunked_loss", engine):
        if engine != engines.NONE:  # one process: nothing changes, nothing said
            engines.step_aside("chunked_loss", engine)
        return ("engine", logging.WARNING, "")
    head = vars(model)["_modules"]["lm_head"]
    for key, level, problem in (("config", logging.INFO, _config_problem(model)),
                                ("loss", logging.INFO, _loss_problem(model)),
                                ("head", logging.WARNING, _head_problem(head)),
                                ("stack", logging.INFO, _outputs_may_be_read())):
        if problem is not None:
            return (f"{key}-{problem}", level, problem)
    return None
