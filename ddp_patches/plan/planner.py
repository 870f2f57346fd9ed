"""The plan of each setup on one GPU and host, and how it is printed: the rows (``plans``), the host memory a row may
pin (NOTE [Host memory]), the text of ``python -m ddp_patches plan`` (``render``, ``main``), and the generated
blocks of docs/benchmarks.md (``readme_block``, ``long_context_block``, with others' published figures).
"""

from __future__ import annotations

from . import memsim
from . import model as sim_model
from .search import (CALIBRATION, SETUPS, GiB, Setup, _check_plan, _Line, limit_of, longest, parse_bytes, setups,
                     simulate, usable)
HOST_PINNABLE = 0.5  # of a GPU's share of host memory, the most the planner lets offload pin (NOTE [Host memory])
DEFAULT_GPUS_PER_NODE = 8

# NOTE [Host memory]
# Rule: a row never assumes more pinned host memory than the options it prints give. Offload's pool is capped per
# rank (``apply(offload_max_pinned_bytes=...)``, default a quarter of RAM / LOCAL_WORLD_SIZE) and takes a power-of-
# two class per input; beyond the cap inputs stay on the GPU (NOTE [Pinned cap in the simulation]). With
# --host-memory the planner lets offload pin at most half of a GPU's share (host / --gpus-per-node): the row is the
# longest under that, and prints the pinned bytes it needs and ``offload_max_pinned_bytes`` where the default cap
# is smaller. Without --host-memory nothing caps the simulation, and every offload row names its explicit cap.
# Test: tests/test_memsim.py::test_plan_names_the_pinned_cap_a_row_needs
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §13


def pinned_limits(host: int | None, gpus_per_node: int) -> tuple[int | None, int | None]:
    """(the default pinned cap per rank, the most the planner lets offload pin per rank); None without a host."""
    if host is None:
        return None, None
    return int(host * 0.25) // gpus_per_node, int(host * HOST_PINNABLE) // gpus_per_node


def _how(setup: Setup, step: memsim.Step | None, default_cap: int | None) -> str:
    """What to pass; for offload, the pinned cap where the default does not give what the row needs."""
    if not setup.features.offload or step is None or not step.pinned:
        return setup.how
    if default_cap is not None and step.pinned <= default_cap:
        return setup.how + " (the default pinned cap suffices)"
    return setup.how.replace("offload=True", f"offload=True, offload_max_pinned_bytes={step.pinned}")


def _rows(task) -> list[dict]:
    """One setup's row of the plan for each budget (its runs kept across them: NOTE [The fast search])."""
    config, setup, budgets, lora_r, seq, batch, quant, default_cap, most_pinned, exact = task
    if setup.features.fused_head and not memsim.fused_head_available():
        return [{"setup": setup.name, "longest": None, "how": setup.how, "at_longest": None, "pinned": 0,
                 "limit": "not simulated: this TRL has no chunked head (trl.kernels); TRL 1.16 has"}] * len(budgets)
    shape = {"batch": batch, "quant": quant, "pinned_cap": most_pinned if setup.features.offload else None}
    line = _Line(config, setup.features, lora_r=lora_r, **shape)
    rows = []
    for budget in budgets:
        if exact:
            n, step = longest(config, setup.features, budget, lora_r=lora_r, fine=True, **shape)
        else:
            n, step = line.longest(budget)
        row = {"setup": setup.name, "longest": n, "how": _how(setup, step, default_cap),
               "limit": limit_of(step) if step else "frozen weights and LoRA state alone",
               "pinned": step.pinned if step else 0, "at_longest": step.as_dict() if step else None}
        if seq:
            at = simulate(config, seq, setup.features, lora_r=lora_r, **shape)
            row["fits_seq"] = at.device <= usable(budget)
            row["at_seq"] = at.as_dict()
        rows.append(row)
    return rows


def default_jobs() -> int:
    """Processes for the setups: two where the CPUs allow and processes fork (NOTE [The fast search])."""
    import multiprocessing
    import os
    import sys

    if sys.platform != "linux" or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, min(2, len(os.sched_getaffinity(0))))


def _map(function, tasks: list, jobs: int) -> list:
    """``function`` over ``tasks``, in order; in ``jobs`` forked processes (the simulation is CPU-bound Python)."""
    if jobs <= 1 or len(tasks) <= 1 or sim_model._models or sim_model._static:
        # a process that has built a simulated model already can hold a lock a forked child waits on forever (seen
        # once): fork only before the first simulation, as the command line does
        return [function(task) for task in tasks]
    import multiprocessing

    _import_before_fork(tasks[0][0])
    with multiprocessing.get_context("fork").Pool(min(jobs, len(tasks)), initializer=_one_thread) as pool:
        return pool.map(function, tasks, chunksize=1)


def _one_thread() -> None:
    """In a forked job: torch's ops run on the calling thread. A parent that ran one parallel op has started its
    OpenMP pool, which a forked child cannot use (the child waits on it forever); the jobs already share the CPUs."""
    import torch

    torch.set_num_threads(1)


def _import_before_fork(config) -> None:
    """The modules every job imports (PEFT, TRL's head, the model's class), imported once here rather than in each
    forked child (seconds each); importing builds no model, so the children may still fork after it."""
    import importlib

    from transformers import AutoModelForCausalLM

    from .. import chunked_loss, tiled_attention, tiled_mlp  # noqa: F401
    for name in ("peft", "transformers.integrations.sdpa_attention"):
        importlib.import_module(name)
    memsim.fused_head_available()  # imports trl.kernels where TRL has it
    try:
        AutoModelForCausalLM._model_mapping[type(config)]  # imports the model's modeling module
    except (KeyError, AttributeError):
        pass  # the child says what is wrong with the config, as before


def _cost(features: memsim.Features) -> int:
    """A setup's relative simulation time: the tiled parts and the chunked head run many more ops."""
    return 4 * features.tiled_attention + 2 * features.tiled_mlp + features.chunked_head


def plan(config, *, budget: int, lora_r: int = 16, seq: int | None = None, batch: int = 1, quant: str | None = None,
         host: int | None = None, gpus_per_node: int = DEFAULT_GPUS_PER_NODE, exact: bool = False,
         jobs: int | None = None) -> dict:
    """The plan for one GPU of ``budget`` bytes: each setup's longest sequence (``render`` prints it)."""
    return plans(config, budgets=[budget], lora_r=lora_r, seq=seq, batch=batch, quant=quant, host=host,
                 gpus_per_node=gpus_per_node, exact=exact, jobs=jobs)[0]


def plans(config, *, budgets: list[int], lora_r: int = 16, seq: int | None = None, batch: int = 1,
          quant: str | None = None, host: int | None = None, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
          exact: bool = False, jobs: int | None = None) -> list[dict]:
    """``plan`` for each of ``budgets``, each setup's runs shared between them (NOTE [The fast search])."""
    config = sim_model._config(config)
    text = sim_model._text_config(config)
    for budget in budgets:
        _check_plan(text, budget, lora_r)
    default_cap, most_pinned = pinned_limits(host, gpus_per_node)
    jobs = default_jobs() if jobs is None else jobs
    tasks = [(config, setup, list(budgets), lora_r, seq, batch, quant, default_cap, most_pinned, exact)
             for setup in setups()]
    # the costliest setups first, so that two processes end together (NOTE [The fast search])
    order = sorted(range(len(tasks)), key=lambda i: -_cost(tasks[i][1].features))
    done = dict(zip(order, _map(_rows, [tasks[i] for i in order], jobs)))
    rows = [done[i] for i in range(len(tasks))]
    return [{"simulation": True, "model_type": text.model_type, "layers": text.num_hidden_layers,
             "hidden": text.hidden_size, "lora_r": lora_r, "budget": budget, "usable": usable(budget), "seq": seq,
             "batch": batch, "quant": quant, "host": host, "gpus_per_node": gpus_per_node,
             "default_pinned_cap": default_cap, "most_pinned": most_pinned, "exact": exact,
             "calibration": CALIBRATION, "rows": [setup_rows[i] for setup_rows in rows]}
            for i, budget in enumerate(budgets)]


QUANT_NOTE = ("QLoRA: the decoder's frozen linear weights counted as bitsandbytes NF4 (0.5 byte a weight plus the "
              "double-quantised state; embeddings, LM head and norms in bf16), plus one dequantised weight; the "
              "activations are simulated in bf16 (no 4-bit model runs on fake tensors)")


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def render(result: dict) -> str:
    quant = result.get("quant")
    batch = result.get("batch", 1)
    lines = [f"ddp_patches plan -- a SIMULATION (fake tensors on the CPU, no GPU was used): {result['model_type']}, "
             f"{result['layers']} layers, hidden {result['hidden']}, {'QLoRA (NF4 base)' if quant else 'LoRA'} "
             f"r={result['lora_r']} on every linear layer, bf16, batch {batch}, one GPU of "
             f"{result['budget'] / GiB:.1f} GiB (live bytes may reach "
             f"{result['usable'] / GiB:.1f} GiB: the rest is kept for the CUDA context and the allocator)",
             f"calibration: {result['calibration']}"]
    if quant:
        lines.append(QUANT_NOTE)
    host = result.get("host")
    if host:
        lines.append(f"host: {_gib(host)} for {result['gpus_per_node']} GPUs: offload's default pinned cap "
                     f"{_gib(result['default_pinned_cap'])} per GPU; the planner lets it pin at most "
                     f"{_gib(result['most_pinned'])} per GPU (half of a GPU's share)")
    elif "host" in result:
        lines.append("host memory not given (--host-memory): offload is not capped; each offload row names the pinned "
                     "host memory it needs per GPU and the cap to set")
    lines.append("")
    seq = result["seq"]
    head = "| setup | longest sequence | pinned host per GPU | limited by | what to pass |"
    if seq:
        head = f"| setup | {seq} tokens fit? | longest sequence | pinned host per GPU | limited by | what to pass |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for row in result["rows"]:
        fits = (f" {'yes' if row['fits_seq'] else 'no'} ({row['at_seq']['device'] / GiB:.1f} GiB) |"
                if seq else "")
        if row["longest"] is None:
            lines.append(f"| {row['setup']} |{' - |' if seq else ''} - | - | {row['limit']} | {row['how']} |")
            continue
        pinned = _gib(row["pinned"]) if row.get("pinned") else "0"
        lines.append(f"| {row['setup']} |{fits} {row['longest']:,} | {pinned} | {row['limit']} | {row['how']} |")
    return "\n".join(lines)


def main(args) -> int:
    import json
    import sys

    host = parse_bytes(args.host_memory) if getattr(args, "host_memory", None) else None
    result = plan(args.config, budget=parse_bytes(args.gpu_memory), lora_r=args.lora_r, seq=args.seq,
                  batch=getattr(args, "batch", 1), quant="nf4" if getattr(args, "qlora", False) else None,
                  host=host, gpus_per_node=getattr(args, "gpus_per_node", DEFAULT_GPUS_PER_NODE),
                  exact=getattr(args, "exact", False), jobs=getattr(args, "jobs", None))
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


LONG_START = ("<!-- long-context:start (python -m ddp_patches plan --config tests/data/llama-3.1-8b --gpu-memory "
              "<size> [--qlora --lora-r 32] --json; docs/data/plan-long-context.json) -->")
LONG_END = "<!-- long-context:end -->"
PUBLISHED = (  # what others publish, with their setups (not simulated here)
    ("Unsloth (blog, 2024): Llama-3.1-8B, QLoRA 4-bit on all linear layers, r=32, batch 1, gradient checkpointing "
     "(Unsloth's offloaded), Unsloth's kernels", {"80 GB": "342,733", "48 GB": "191,728", "40 GB": "153,977",
                                                  "24 GB": "78,475"}),
    ("Unsloth's baseline: the same with Hugging Face + FlashAttention-2", {"80 GB": "28,454"}),
    ("ALST (Arctic Long Sequence Training, 2025): Llama-3.1-8B full fine-tuning, weights and optimizer states on "
     "the host (ZeRO-3 offload), one H100 80 GB", {"80 GB": "500K"}),
    ("ALST's ladder on one H200 141 GB: baseline / + tiled loss / + checkpoint offload to the host / + tiled MLP",
     {"141 GB": "65K / 300K / 650K / 1.2M"}),
)


UNSLOTH_HF = 28454  # Unsloth's published Hugging Face + FlashAttention-2 baseline, QLoRA r=32, 80 GB
UNSLOTH_BASELINE = Setup(
    "plain HF as a 2024 QLoRA recipe runs it", memsim.Features(kbit_prep=True, legacy_loss=True),
    "PEFT's prepare_model_for_kbit_training (float32 embeddings, norms and LM head; bf16 autocast), transformers "
    "4.44's loss (all logits in float32, a shifted copy)")


def baseline_row(config, budget: int = 80 * 10**9, *, lora_r: int = 32, quant: str | None = "nf4") -> dict:
    """Unsloth's HF baseline (QLoRA r=32, batch 1, 80 GB) as its recipe most likely ran, in memsim:
    NOTE [The k-bit preparation's float32]."""
    config = sim_model._config(config)
    n, step = _Line(config, UNSLOTH_BASELINE.features, lora_r=lora_r, quant=quant).longest(budget)
    return {"setup": UNSLOTH_BASELINE.name, "how": UNSLOTH_BASELINE.how, "budget": budget, "longest": n,
            "limit": limit_of(step) if step else "frozen weights and LoRA state alone",
            "at_longest": step.as_dict() if step else None}


def long_context_block(results: dict[str, dict], calibration: dict | None = None) -> str:
    """The long-context table of docs/benchmarks.md: per side (LoRA r=16, QLoRA r=32) and GPU size, each setup's
    longest sequence and the pinned host memory it needs per GPU; then what others publish, with their setups.
    ``results``: ``"<side> <size>"`` (e.g. ``"QLoRA r=32 80GiB"``) -> a plan; ``calibration``: the plan of
    Unsloth's baseline setup (QLoRA r=32, 80 GB), whose plain HF row is set beside their figure."""
    sides = sorted({key.rsplit(" ", 1)[0] for key in results}, key=lambda side: side.startswith("Q"))
    sizes = sorted({key.rsplit(" ", 1)[1] for key in results}, key=lambda size: parse_bytes(size))
    lines = [LONG_START, ""]
    options = {s.name: s.how for s in setups()}
    for side in sides:
        first = results[f"{side} {sizes[0]}"]
        head = (f"| Llama-3.1-8B, {side}, batch 1 (simulated; in brackets the pinned host memory per GPU) | "
                + " | ".join(f"{size} GPU" for size in sizes) + " | options (offload: `offload_max_pinned_bytes` "
                "at least the bracket) |")
        lines += [head, "|---|" + "---|" * (len(sizes) + 1)]
        for row in first["rows"]:
            cells = []
            for size in sizes:
                (found,) = [r for r in results[f"{side} {size}"]["rows"] if r["setup"] == row["setup"]]
                if found["longest"] is None:
                    cells.append("-")
                    continue
                pinned = f" ({found['pinned'] / GiB:.1f} GiB)" if found.get("pinned") else ""
                cells.append(f"{found['longest']:,}{pinned}")
            lines.append(f"| {row['setup']} | " + " | ".join(cells) + f" | {options.get(row['setup'], '')} |")
        lines.append("")
    columns = ["24 GB", "40 GB", "48 GB", "80 GB", "141 GB"]
    lines += ["| published (their setup) | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for setup, figures in PUBLISHED:
        lines.append(f"| {setup} | " + " | ".join(figures.get(c, "") for c in columns) + " |")
    if calibration is not None:
        plain = calibration["rows"][0]["longest"]
        lines += ["", f"Unsloth's baseline setup simulated (Llama-3.1-8B, QLoRA r=32, batch 1, plain HF, 80 GB read as "
                      f"{calibration['budget']:,} bytes): **{plain:,} tokens** against their {UNSLOTH_HF:,} "
                      f"({plain / UNSLOTH_HF - 1:+.0%})."]
        kbit = calibration.get("unsloth_baseline")
        if kbit:
            n = kbit["longest"]
            lines[-1] += (f" Run as a 2024 QLoRA recipe runs it ({kbit['how']}): **{n:,} tokens** "
                          f"({n / UNSLOTH_HF - 1:+.0%}); limited by {kbit['limit']}.")
    return "\n".join(lines + ["", LONG_END])
