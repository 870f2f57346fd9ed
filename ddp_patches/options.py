"""apply()'s options, declared once: name, kind, default, bounds or choices, environment variable, one-line doc.

``OPTIONS`` (apply()'s keyword order) is what apply() validates with (``check``), what ``ddp-patches-run`` parses
its flags and ``DDP_PATCHES_*`` variables with (``parse``), what the axolotl plugin builds its schema from, and
what ``python -m tools.options_tables`` renders the README's and docs/options.md's tables from. apply() keeps
its explicit keyword arguments (what IDEs and readers see); tests/test_options.py checks they equal this table.
Imports nothing: it loads at start-up in every process a ``ddp-patches-run`` launch starts
(NOTE [Apply when torch is imported]).
"""

from __future__ import annotations

ENV_PREFIX = "DDP_PATCHES_"
PINNED_DEFAULT = "1/4 of min(RAM, cgroup limit) / `LOCAL_WORLD_SIZE`"  # offload/pinned_pool.default_cap_bytes
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_AUTO = ("auto", "none", "")


class Option:
    """One apply() keyword. ``kind``: "bool" (True/False), "choice" (one of ``choices``; ``legacy`` values are
    accepted but not advertised), or "int" (a whole number >= ``least``; None too when ``automatic``)."""

    __slots__ = ("name", "kind", "default", "doc", "when", "choices", "legacy", "least", "automatic", "noun",
                 "meaning", "default_text", "hint")

    def __init__(self, name, kind, default, doc, when, *, choices=(), legacy=(), least=None, automatic=False,
                 noun="", meaning="", default_text="", hint=""):
        self.name, self.kind, self.default, self.doc, self.when = name, kind, default, doc, when
        self.choices, self.legacy, self.least, self.automatic = choices, legacy, least, automatic
        self.noun, self.meaning, self.default_text, self.hint = noun, meaning, default_text, hint

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def expects(self) -> str:
        """What apply() accepts, in words."""
        if self.kind == "bool":
            return "True or False"
        if self.kind == "choice":
            return _either([repr(c) for c in (*self.legacy, *self.choices)])
        return (("None (automatic) or " if self.automatic else "") + f"{self.noun} >= {self.least}"
                + (f" ({self.meaning})" if self.meaning else ""))

    def check(self, value):
        """``value`` if apply() accepts it; else TypeError (a bool option) or ValueError saying what was expected,
        what was found and what to do."""
        if self.kind == "bool":
            ok = isinstance(value, bool)
        elif self.kind == "choice":
            ok = any(value == c and type(value) is type(c) for c in (*self.legacy, *self.choices))
        else:
            ok = (value is None and self.automatic) or (
                isinstance(value, int) and not isinstance(value, bool) and value >= self.least)
        if ok:
            return value
        error = TypeError if self.kind == "bool" else ValueError  # the types apply() has always raised
        raise error(f"ddp_patches.apply({self.name}=...) expects {self.expects()}, got {value!r}; leave it out for "
                    f"the default ({self.shown_default(code=False)}){self.hint}")

    def parse(self, text: str):
        """The value of a flag or variable's text; ValueError("expected ...") where it is not one."""
        word = text.strip().lower()
        if self.kind == "int":
            if self.automatic and word in _AUTO:
                return None
            try:
                value = int(word)
            except ValueError:
                raise ValueError(f"expected a whole number >= {self.least}"
                                 + (" or auto" if self.automatic else "")) from None
            if value < self.least:
                raise ValueError(f"expected a number >= {self.least}")
            return value
        accepted = (*self.legacy, *self.choices) if self.kind == "choice" else (True, False)
        for value in accepted:
            if word == str(value).lower() or (value is True and word in _TRUE) or (value is False and word in _FALSE):
                return value
        raise ValueError("expected " + _either([str(value).lower() for value in accepted]))

    def shown_default(self, code: bool = True) -> str:
        """The default as the tables show it (``code``: in Markdown backticks where it is a Python value)."""
        if self.default_text:
            return self.default_text if code else self.default_text.replace("`", "")
        text = f'"{self.default}"' if isinstance(self.default, str) else repr(self.default)
        return text if not code or (isinstance(self.default, int) and not isinstance(self.default, bool)) \
            else f"`{text}`"

    def values(self) -> str:
        """The text values a flag or variable takes, for the docs."""
        if self.kind == "int":
            text = "N" if self.least == 0 else f"N >= {self.least}"
            return text + (" or `auto`" if self.automatic else "") + (f" ({self.meaning})" if self.meaning else "")
        accepted = self.choices if self.kind == "choice" else (True, False)
        text = " / ".join(f"`{str(value).lower()}`" for value in accepted)
        return text + "".join(f" (`{value}` is read as {str(self.default).lower()})" for value in self.legacy)


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


# apply()'s keywords, in its order.
OPTIONS: tuple[Option, ...] = (
    Option("checkpointing", "bool", True,
           "under DDP and DeepSpeed ZeRO-1/2, every reentrant checkpoint runs as `use_reentrant=False` (one WARNING "
           "line says so)",
           "never, unless you want torch's behaviour back"),
    Option("reducer", "bool", True,
           "your DDP settings stay as given; unused trainable parameters are marked where DDP expects them; static "
           "graph + accumulation synchronises the first step; the trainable-set check; a clean "
           "`destroy_process_group`",
           "never, unless you want torch's behaviour back"),
    Option("offload", "choice", False,
           "moves each checkpoint's input (a layer's hidden states) to pinned host memory until backward; CUDA, "
           "torch >= 2.8",
           "activation memory limits your sequence length (opt-in: see what has run on a GPU in "
           "[docs/benchmarks.md](docs/benchmarks.md))",
           choices=(True, False), legacy=("auto",)),
    Option("tiled_mlp", "bool", False,
           "every gate/up/down MLP (any family, found by structure) runs in token shards, recomputed shard by shard "
           "in backward; each DDP hook still fires once",
           "long sequences, where the MLP's intermediates dominate"),
    Option("tiled_mlp_shard_tokens", "int", None,
           "`None`: shards by bytes, untiled below 2 shards; `N`: at most N tokens per shard, always tiled",
           "you want a fixed shard size",
           least=1, automatic=True, noun="a number of tokens per shard"),
    Option("tiled_attention", "bool", False,
           "under DDP, FSDP2 and DeepSpeed ZeRO-1/2, each layer's input norm, q/k/v and o_proj (LoRA included) run "
           "in token shards around the whole-sequence attention kernel, and the other norms (before the MLP, the "
           "model's last) per shard too; each DDP hook still fires once",
           "long sequences: with LoRA their float32 copies dominate a layer's backward"),
    Option("tiled_attention_shard_tokens", "int", None,
           "`None`: 4 shards from 2 x hidden_size tokens; `N`: at most N tokens per shard",
           "you want a fixed shard size",
           least=1, automatic=True, noun="a number of tokens per shard"),
    Option("chunked_loss", "bool", False,
           "in training, a causal LM (any family, VLMs and PEFT included) called with `labels` computes its loss "
           "from the hidden states in chunks of tokens, never building the full logits; its `logits` output is "
           "then None; under DDP, FSDP2 and DeepSpeed ZeRO-1/2",
           "long sequences or large vocabularies, where the logits dominate (Llama-3.1-8B at 64K tokens, "
           "simulated: 126 GiB at peak for the loss path, 6.4 GiB chunked)"),
    Option("offload_min_bytes", "int", 1 << 20,
           "smaller tensors stay on the GPU",
           "rarely",
           least=0, noun="a number of bytes", default_text="1 MiB"),
    Option("offload_max_pinned_bytes", "int", None,
           "per-rank cap on pinned host memory; beyond it tensors stay on the GPU",
           "host memory is shared with other work",
           least=0, automatic=True, noun="a number of bytes", default_text=PINNED_DEFAULT),
    Option("offload_prefetch_depth", "int", 1,
           "layer inputs copied back ahead of backward",
           "`offload_stats().stall_ms` grows (slow bus, small layers)",
           least=1, noun="a whole number", meaning="layer inputs copied back ahead",
           hint=", or pass 2 or more to overlap more copies at the cost of one more layer input in device memory "
                "each"),
    Option("offload_max_in_flight", "int", 1,
           "checkpoints whose inputs stay on the GPU while their copy runs",
           "the forward waits for the copies (fast GPU, small layers)",
           least=1, noun="a whole number", meaning="checkpoint regions whose copies out may still run",
           hint=", or pass 2 or more to overlap more copies at the cost of one more layer input in device memory "
                "each"),
    Option("on_unsynced", "choice", "warn",
           "gradients DDP never averaged, or replicas that drifted apart: one WARNING/ERROR line; `\"raise\"`: an "
           "exception; `\"off\"`: no guard",
           "`\"raise\"` to stop such a run",
           choices=("warn", "raise", "off")),
    Option("replica_check_every", "int", 100,
           "compares a fingerprint of the trainable parameters across ranks before steps 1, 2 and every N-th",
           "`0` turns it off",
           least=0, noun="a number of optimizer steps", meaning="0: off"),
)

BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}
DEFAULTS: dict[str, object] = {option.name: option.default for option in OPTIONS}


def check(values: dict) -> dict:
    """apply()'s keywords, each checked against its Option (TypeError / ValueError naming the first bad one)."""
    return {name: BY_NAME[name].check(value) for name, value in values.items()}


def pydantic_model(model_name: str, prefix: str, module: str):
    """A pydantic model with one optional field ``prefix + name`` per option (unset: apply()'s default), whose
    bounds and choices are the table's (the axolotl plugin's schema; needs pydantic). ``offload``'s legacy "auto"
    is left out: a config written today says true or false."""
    from typing import Literal, Optional

    from pydantic import Field, StrictInt, create_model

    fields = {}
    for option in OPTIONS:
        if option.kind == "int":
            # strict: a YAML ``true`` is not the count 1, as apply() refuses a bool there
            fields[prefix + option.name] = (Optional[StrictInt], Field(default=None, ge=option.least))
        elif option.kind == "bool" or all(isinstance(choice, bool) for choice in option.choices):
            fields[prefix + option.name] = (Optional[bool], None)
        else:
            fields[prefix + option.name] = (Optional[Literal[option.choices]], None)
    return create_model(model_name, __module__=module, __doc__=f"apply()'s keywords as config keys "
                        f"(``{prefix}<keyword>``); unset keys keep apply()'s defaults.", **fields)
