"""The longest sequence one setup trains on one GPU: the setups compared, the budget a GPU's bytes leave, and the
search over lengths (bisection, or the line through two simulated lengths: NOTE [The fast search]), each length
simulated by ``memsim`` (fake tensors, no GPU, no network: a local config.json or model folder).
"""

from __future__ import annotations

import dataclasses
import re

from . import memsim
from . import model as sim_model

GiB = memsim.GiB
RESERVE_BYTES = 1 * GiB  # the CUDA context and allocator workspaces, beside the fragmentation share below
RESERVE_FRACTION = 0.05  # what a caching allocator holds beyond the live bytes (not simulated)
CALIBRATION = ("within 1.2% of the active peaks measured on an H100 (docs/data/gpu-proof.json, 2026-11-23: eight "
               "Llama-8B-shaped layers at 8K and 16K with the unfused head, offload off and on; the Llama MLP at 8K "
               "and 32K, tiled and not). Not calibrated on a GPU: TRL's fused head, more than 8 layers (the peak "
               "is extrapolated from 3 and 4), the reserve kept for the allocator")


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    features: memsim.Features
    how: str  # what to pass


SETUPS = (
    Setup("plain HF (checkpointing, unfused head)", memsim.Features(), "transformers alone"),
    Setup("best unpatched (+ fused head)", memsim.Features(fused_head=True),
          "TRL SFTTrainer (fused head), no apply() option"),
    Setup("+ offload", memsim.Features(offload=True, fused_head=True), "apply(offload=True), TRL SFTTrainer"),
    Setup("+ tiled MLP", memsim.Features(tiled_mlp=True, fused_head=True), "apply(tiled_mlp=True), TRL SFTTrainer"),
    Setup("patched (tiled MLP + offload + fused head)", memsim.Features(tiled_mlp=True, offload=True, fused_head=True),
          "apply(tiled_mlp=True, offload=True), TRL SFTTrainer"),
    Setup("patched, unfused head (HF Trainer)", memsim.Features(tiled_mlp=True, offload=True),
          "apply(tiled_mlp=True, offload=True), transformers' Trainer"),
)
PATCHED = SETUPS[4].name
MOST_TOKENS = 1 << 24  # the longest sequence the planner searches or checks (16M tokens)
MOST_BYTES = 1 << 50  # the largest --gpu-memory taken (1 PiB): beyond any GPU


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``81920MiB`` or a number of bytes, at most ``MOST_BYTES``."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"expected a size such as 80GiB, 80GB or 85899345920; found {text!r}")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}[unit]
    if number * scale > MOST_BYTES:
        raise ValueError(f"expected a GPU's memory, at most 1 PiB; found {text!r}")
    return int(number * scale)


def check_arguments(args) -> None:
    """The command line's values, before any config is read; a ValueError naming the flag."""
    try:
        parse_bytes(args.gpu_memory)
    except ValueError as e:
        raise ValueError(f"--gpu-memory: {e}") from None
    if args.lora_r < 1:
        raise ValueError(f"--lora-r expects a number >= 1; found {args.lora_r}")
    if getattr(args, "host_memory", None):
        try:
            parse_bytes(args.host_memory)
        except ValueError as e:
            raise ValueError(f"--host-memory: {e}".replace("a GPU's memory", "a host's memory")) from None
    if not 1 <= getattr(args, "batch", 1) <= 4096:
        raise ValueError(f"--batch expects a number of sequences from 1 to 4096; found {args.batch}")
    if not 1 <= getattr(args, "gpus_per_node", 1) <= 1024:
        raise ValueError(f"--gpus-per-node expects a number from 1 to 1024; found {args.gpus_per_node}")
    if getattr(args, "jobs", None) is not None and not 1 <= args.jobs <= 64:
        raise ValueError(f"--jobs expects a number of processes from 1 to 64; found {args.jobs}")
    if args.seq is not None and not 1 <= args.seq <= MOST_TOKENS:
        raise ValueError(f"--seq expects a number of tokens from 1 to {MOST_TOKENS} (2^24, the longest the planner "
                         f"searches); found {args.seq}")


def usable(budget: int) -> int:
    """What the live bytes of a step may reach under ``budget``: NOTE [What the simulation models]."""
    return int(budget * (1 - RESERVE_FRACTION)) - RESERVE_BYTES


def limit_of(step: memsim.Step) -> str:
    """The largest part of the peak, the next thing to tile or offload; the transient is named by where the
    simulated peak was (a decoder layer's recompute, or the LM head and loss)."""
    inputs = step.layers * step.per_layer
    transient = "one layer's recompute" if step.peak_in == "layer" else "the LM head and loss"
    parts = {"frozen weights": step.weights, "checkpoint inputs on the device (S x H per layer)": inputs,
             transient: step.activations - inputs}
    return max(parts, key=parts.get)


def longest(config, features: memsim.Features, budget: int, *, lora_r: int = 16, resolution: int = 1024,
            first: int = 16384, most: int = MOST_TOKENS, fine: bool = False,
            **shape) -> tuple[int, memsim.Step | None]:
    """The longest multiple of ``resolution`` (to 1/64 of it; to ``resolution`` itself when ``fine``) whose step
    fits ``usable(budget)``; (0, None) if none does. ``shape``: ``simulate``'s batch, quant and pinned_cap.

    The device bytes grow with the length, about linearly (flash-style attention; a checkpointed layer keeps S x H)
    but not exactly (TRL's chunked head works in chunks of 32K tokens), so the search brackets the answer (linear
    jumps up from ``first``) and then narrows it by interpolation, falling back to halving when a side repeats.
    """
    cap = usable(budget)

    def device(n: int) -> memsim.Step:
        return simulate(config, n, features, lora_r=lora_r, **shape)

    lo, lo_step, hi, hi_bytes = 0, None, None, None
    n = first
    while hi is None:
        step = device(n)
        if step.device > cap:
            hi, hi_bytes = n, step.device
        elif n >= most:
            return n, step
        else:
            previous = (lo, lo_step.device) if lo_step else None
            lo, lo_step = n, step
            slope = (step.device - previous[1]) / (n - previous[0]) if previous else step.device / n
            jump = int((cap - step.device) / slope * 1.1) if slope > 0 else n
            n = min(most, n + max(resolution, min(jump, 4 * n)) // resolution * resolution)
    if lo_step is None:
        if hi <= resolution:
            return 0, None
        lo_step = device(resolution)
        if lo_step.device > cap:
            return 0, None
        lo = resolution
    last, repeats = None, 0
    while hi - lo > (resolution if fine else max(resolution, lo // 64)):  # 1.6%: finer than the simulation's error
        if repeats >= 2:  # interpolation kept moving the same end: halve instead
            guess = lo + (hi - lo) // 2
        else:
            guess = lo + int((hi - lo) * (cap - lo_step.device) / (hi_bytes - lo_step.device))
        guess = min(max(guess // resolution * resolution, lo + resolution), hi - resolution)
        step = device(guess)
        side = "lo" if step.device <= cap else "hi"
        repeats = repeats + 1 if side == last else 1
        last = side
        if side == "lo":
            lo, lo_step = guess, step
        else:
            hi, hi_bytes = guess, step.device
    return lo, lo_step


FIT_LENGTHS = (16384, 32768)  # the two lengths the fast search fits the line through (full 3- and 4-layer runs)

# NOTE [The fast search]
# Rule: with flash-style attention a step's bytes are affine in the length for one set of features, piecewise
# (TRL's head in 4K-token tiles; the tiled MLP's shard count grows to its cap; a pinned cap keeps inputs on the
# GPU). Per setup, three short runs give the line: 3 and 4 layers at the first of FIT_LENGTHS (the per-layer
# increment: a kept input, proportional to the length, or a constant once offloaded), 3 layers at the second.
# Its crossing of each budget is checked by one 3-layer run plus the increment; where the check disagrees, each
# further run corrects the guess by the line through the nearest points (halving after four), until one step
# of the resolution more does not fit by the local line. The increment is re-measured (a 4-layer run) only where
# the answer's peak is in another phase than the first run's. The runs are kept across budgets (``plans``).
# ``--exact`` keeps the full search (to the resolution); both agree to 1024 tokens (small config, Llama-8B).
# The setups run in two forked processes where the machine has two CPUs (``--jobs``), the costliest first.
# Test: tests/test_memsim.py::test_fast_search_matches_the_exact_one
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §13


class _Line:
    """One setup's runs, kept across budgets: NOTE [The fast search]."""

    def __init__(self, config, features: memsim.Features, *, lora_r: int = 16, resolution: int = 1024,
                 most: int = MOST_TOKENS, pinned_cap: int | None = None, **shape) -> None:
        self.config, self.features, self.lora_r, self.resolution, self.most = config, features, lora_r, resolution, most
        self.pinned_cap, self.shape = pinned_cap, shape
        self.whole = sim_model._text_config(config).num_hidden_layers <= memsim.PROBE_LAYERS[1]  # the cap applied inside
        self.runs: dict[int, memsim.Step] = {}  # length -> its step, offload not capped (unless run whole)
        self.first: memsim.Step | None = None

    def run(self, n: int) -> memsim.Step:
        per_layer = None if self.whole or self.first is None else self.per_layer(n)
        step = simulate(self.config, n, self.features, lora_r=self.lora_r, per_layer=per_layer,
                        pinned_cap=self.pinned_cap if self.whole else None, **self.shape)
        self.first = self.first or step
        self.runs[n] = step
        return step

    def per_layer(self, n: int) -> tuple[int, int]:
        """(device, host) bytes one more layer adds at ``n``: a kept input (proportional) or offloaded (constant)."""
        n1, first = FIT_LENGTHS[0], self.first
        device_bytes = first.per_layer if self.features.offload else first.per_layer * n // n1
        return device_bytes, first.per_layer_host * n // n1

    def device(self, step: memsim.Step) -> int:
        return step.device if self.whole else memsim.capped(step, self.pinned_cap).device

    def extra(self, n: int, phase: str) -> int:
        """What the pinned cap adds at ``n`` (0 run whole: measured in the run)."""
        if self.whole:
            return 0
        probe = dataclasses.replace(self.first, activations=0, peak_in=phase, per_layer_host=self.per_layer(n)[1])
        return memsim.capped(probe, self.pinned_cap).activations

    def guess(self, cap: int, p0: tuple[int, memsim.Step], p1: tuple[int, memsim.Step]) -> int:
        """The longest multiple of the resolution the line through two runs (plus the cap's share) keeps within
        ``cap``; 0 where none."""
        (x0, s0), (x1, s1) = p0, p1
        rate = (s1.device - s0.device) / (x1 - x0)
        lo, hi = 0, self.most // self.resolution + 1  # in steps of the resolution: fits(lo * resolution) or lo == 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            n = mid * self.resolution
            lo, hi = (mid, hi) if s0.device + (n - x0) * rate + self.extra(n, s1.peak_in) <= cap else (lo, mid)
        return lo * self.resolution

    def longest(self, budget: int) -> tuple[int, memsim.Step | None]:
        cap, resolution, runs = usable(budget), self.resolution, self.runs
        for n in FIT_LENGTHS:
            if n not in runs:
                self.run(n)
        for turn in range(16):  # each turn one 3-layer run (with the known increment) at the guess
            points = sorted(runs.items())
            below = [p for p in points if self.device(p[1]) <= cap]
            above = [p for p in points if self.device(p[1]) > cap]
            lo = below[-1] if below else (0, None)
            hi = above[0] if above else None
            if hi is not None and hi[0] - lo[0] <= resolution or lo[0] >= self.most:
                break
            if lo[1] is not None and hi is not None:
                pair = (lo, hi)
            elif hi is None:
                pair = tuple(below[-2:])
            else:
                pair = tuple(above[:2])
            n = self.guess(cap, *pair)
            if turn >= 4 and hi is not None:  # the line keeps missing: halve the bracket
                n = (lo[0] + hi[0]) // 2 // resolution * resolution
            if hi is not None:
                n = min(n, hi[0] - resolution)
            if n <= lo[0]:
                if lo[1] is not None or n > 0 or resolution in runs:
                    break  # one step of the resolution more does not fit by the local line
                n = resolution
            if n in runs:
                break
            self.run(n)
        below = [p for p in sorted(runs.items()) if self.device(p[1]) <= cap]
        if not below:
            return 0, None
        n, step = below[-1]
        if self.whole:
            return n, step
        if step.peak_in == self.first.peak_in:  # the increment measured at the first length holds
            return n, memsim.capped(step, self.pinned_cap)
        shape = {"lora_r": self.lora_r, "pinned_cap": self.pinned_cap, **self.shape}
        for n in range(n, max(0, n - 8 * resolution), -resolution):  # the peak moved: 3 and 4 layers in full
            full = simulate(self.config, n, self.features, **shape)
            if full.device <= cap:
                return n, full
        return longest(self.config, self.features, budget, resolution=resolution, fine=True, **shape)


def longest_fast(config, features: memsim.Features, budget: int, *, lora_r: int = 16, resolution: int = 1024,
                 most: int = MOST_TOKENS, pinned_cap: int | None = None, **shape) -> tuple[int, memsim.Step | None]:
    """``longest`` from a line and a few checks: NOTE [The fast search]."""
    return _Line(config, features, lora_r=lora_r, resolution=resolution, most=most, pinned_cap=pinned_cap,
                 **shape).longest(budget)


def simulate(config, seq: int, features: memsim.Features, *, lora_r: int, **shape) -> memsim.Step:
    """``memsim.simulate``; a config that transformers builds but cannot run at ``seq`` tokens (an encoder set up as
    a decoder with 512 positions, a shape its layers refuse) is a ValueError on one line, not a traceback."""
    try:
        return memsim.simulate(config, seq, features, lora_r=lora_r, **shape)
    except (RuntimeError, ArithmeticError, LookupError, TypeError, AttributeError) as e:
        model_type = getattr(config, "model_type", "the model")
        raise ValueError(f"ddp_patches plan: a step of {model_type} at {seq:,} tokens failed in the "
                         f"simulation ({type(e).__name__}: {sim_model._first_line(e)}): expected the config of a "
                         "decoder-only causal LM that runs at this length (e.g. llama, qwen2, mistral)") from None


def _check_plan(text, budget: int, lora_r: int) -> None:
    if usable(budget) <= 0:
        raise ValueError(f"--gpu-memory {budget / GiB:.1f} GiB leaves nothing for a step once "
                         f"{RESERVE_FRACTION:.0%} and {RESERVE_BYTES / GiB:.0f} GiB are kept for the allocator and "
                         "the CUDA context: expected more than 1.1 GiB")
    hidden = getattr(text, "hidden_size", None)
    if isinstance(hidden, int) and lora_r > hidden:
        raise ValueError(f"--lora-r expects at most the model's hidden size ({hidden}: a higher rank adds nothing); "
                         f"found {lora_r}")


def setups() -> tuple[Setup, ...]:
    """``SETUPS`` and the rows of the library's longest-context options: the chunked loss (every trainer) and the
    tiled attention."""
    return SETUPS + (
        Setup("patched, chunked loss (HF Trainer)", memsim.Features(tiled_mlp=True, offload=True, chunked_loss=True),
              "apply(tiled_mlp=True, offload=True, chunked_loss=True), transformers' Trainer"),
        Setup("patched + tiled attention", memsim.Features(tiled_mlp=True, offload=True, fused_head=True,
                                                          tiled_attention=True),
              "apply(tiled_mlp=True, offload=True, tiled_attention=True), TRL SFTTrainer"),
        Setup("patched + tiled attention, chunked loss (HF Trainer)",
              memsim.Features(tiled_mlp=True, offload=True, chunked_loss=True, tiled_attention=True),
              "apply(tiled_mlp=True, offload=True, tiled_attention=True, chunked_loss=True), transformers' Trainer"),
    )
