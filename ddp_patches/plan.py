"""``python -m ddp_patches plan --config PATH``: the longest sequence each setup trains on one GPU, simulated.

Runs ``ddp_patches.memsim`` (fake tensors, no GPU, no network: a local config.json or model folder) for each
setup and prints whether ``--seq`` fits, the longest length that does, what limits it and what to pass.
"""

from __future__ import annotations

import dataclasses
import re

from . import memsim

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
            first: int = 16384, most: int = MOST_TOKENS) -> tuple[int, memsim.Step | None]:
    """The longest multiple of ``resolution`` (to 1/64 of it) whose step fits ``usable(budget)``; (0, None) if
    none does.

    The device bytes grow with the length, about linearly (flash-style attention; a checkpointed layer keeps S x H)
    but not exactly (TRL's chunked head works in chunks of 32K tokens), so the search brackets the answer (linear
    jumps up from ``first``) and then narrows it by interpolation, falling back to halving when a side repeats.
    """
    cap = usable(budget)

    def device(n: int) -> memsim.Step:
        return simulate(config, n, features, lora_r=lora_r)

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
    while hi - lo > max(resolution, lo // 64):  # within 1.6%: finer than the simulation's own error
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


def simulate(config, seq: int, features: memsim.Features, *, lora_r: int) -> memsim.Step:
    """``memsim.simulate``; a config that transformers builds but cannot run at ``seq`` tokens (an encoder set up as
    a decoder with 512 positions, a shape its layers refuse) is a ValueError on one line, not a traceback."""
    try:
        return memsim.simulate(config, seq, features, lora_r=lora_r)
    except (RuntimeError, ArithmeticError, LookupError, TypeError, AttributeError) as e:
        model_type = getattr(config, "model_type", "the model")
        raise ValueError(f"ddp_patches plan: a step of {model_type} at {seq:,} tokens failed in the "
                         f"simulation ({type(e).__name__}: {memsim._first_line(e)}): expected the config of a "
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


def plan(config, *, budget: int, lora_r: int = 16, seq: int | None = None) -> dict:
    config = memsim._config(config)
    text = memsim._text_config(config)
    rows = []
    _check_plan(text, budget, lora_r)
    for setup in SETUPS:
        if setup.features.fused_head and not memsim.fused_head_available():
            rows.append({"setup": setup.name, "longest": None, "how": setup.how, "at_longest": None,
                         "limit": "not simulated: this TRL has no chunked head (trl.kernels); TRL 1.16 has"})
            continue
        n, step = longest(config, setup.features, budget, lora_r=lora_r)
        row = {"setup": setup.name, "longest": n, "how": setup.how,
               "limit": limit_of(step) if step else "frozen weights and LoRA state alone",
               "at_longest": step.as_dict() if step else None}
        if seq:
            at = simulate(config, seq, setup.features, lora_r=lora_r)
            row["fits_seq"] = at.device <= usable(budget)
            row["at_seq"] = at.as_dict()
        rows.append(row)
    return {"simulation": True, "model_type": text.model_type, "layers": text.num_hidden_layers,
            "hidden": text.hidden_size, "lora_r": lora_r, "budget": budget, "usable": usable(budget), "seq": seq,
            "calibration": CALIBRATION, "rows": rows}


def render(result: dict) -> str:
    lines = [f"ddp_patches plan -- a SIMULATION (fake tensors on the CPU, no GPU was used): {result['model_type']}, "
             f"{result['layers']} layers, hidden {result['hidden']}, LoRA r={result['lora_r']} on every linear "
             f"layer, bf16, batch 1, one GPU of {result['budget'] / GiB:.1f} GiB (live bytes may reach "
             f"{result['usable'] / GiB:.1f} GiB: the rest is kept for the CUDA context and the allocator)",
             f"calibration: {result['calibration']}", ""]
    seq = result["seq"]
    head = "| setup | longest sequence | limited by | what to pass |"
    if seq:
        head = f"| setup | {seq} tokens fit? | longest sequence | limited by | what to pass |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for row in result["rows"]:
        fits = (f" {'yes' if row['fits_seq'] else 'no'} ({row['at_seq']['device'] / GiB:.1f} GiB) |"
                if seq else "")
        if row["longest"] is None:
            lines.append(f"| {row['setup']} |{' - |' if seq else ''} - | {row['limit']} | {row['how']} |")
            continue
        lines.append(f"| {row['setup']} |{fits} {row['longest']:,} | {row['limit']} | {row['how']} |")
    return "\n".join(lines)


def main(args) -> int:
    import json
    import sys

    result = plan(args.config, budget=parse_bytes(args.gpu_memory), lora_r=args.lora_r, seq=args.seq)
    sys.stdout.write((json.dumps(result, indent=2) if args.json else render(result)) + "\n")
    return 0


README_START = "<!-- max-seq-simulated:start (python -m ddp_patches plan --config tests/data/<model> --json) -->"
README_END = "<!-- max-seq-simulated:end -->"


def readme_block(results: dict[str, dict]) -> str:
    """The table of docs/benchmarks.md: per model, the longest sequence of plain HF, the best unpatched and the
    patched setup."""
    names = [s.name for s in SETUPS]
    lines = [README_START, "",
             "| model (80 GiB GPU, LoRA r=16, bf16) | (b) plain HF | (a) best unpatched (TRL fused head) | + offload "
             "| + tiled MLP | patched (both + fused head) | patched / (a) | patched / (b) | what limits the patched side "
             "| patched with an unfused head (HF Trainer): limit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, result in results.items():
        rows = {row["setup"]: row for row in result["rows"]}
        n = [rows[name]["longest"] for name in names]
        lines.append(f"| {label} | {n[0]:,} | {n[1]:,} | {n[2]:,} | {n[3]:,} | {n[4]:,} | {n[4] / n[1]:.2f}x | "
                     f"{n[4] / n[0]:.2f}x | {rows[names[4]]['limit']} | {n[5]:,}: {rows[names[5]]['limit']} |")
    return "\n".join(lines + ["", README_END])
