"""``python -m tools.long_context``: the planner's long-context table of docs/benchmarks.md (Llama-3.1-8B, LoRA r=16
and QLoRA r=32, at 24, 48, 80 and 141 GiB, and Unsloth's baseline setup at 80 GB), written to
docs/data/plan-long-context.json and rendered between the block's markers (``--render-only``: from the JSON)."""

from __future__ import annotations

import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "data", "plan-long-context.json")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
CONFIG = os.path.join(ROOT, "tests", "data", "llama-3.1-8b")
SIDES = {"LoRA r=16": (16, None), "QLoRA r=32": (32, "nf4")}  # (rank, quant): --lora-r 16; --qlora --lora-r 32
SIZES = ("24GiB", "48GiB", "80GiB", "141GiB")


def _plans(budgets: list[str], lora_r: int, quant: str | None) -> list[dict]:
    """The planner for Llama-3.1-8B at each budget, one setup's runs shared across them (``plan.plans``)."""
    from ddp_patches import plan

    return plan.plans(CONFIG, budgets=[plan.parse_bytes(b) for b in budgets], lora_r=lora_r, quant=quant)


def render(data: dict) -> None:
    from ddp_patches import plan

    block = plan.long_context_block(data["results"], data["calibration"])
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    page = re.sub(r"<!-- long-context:start.*?<!-- long-context:end -->", lambda _: block, page, flags=re.S)
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(page)


def main(argv: list[str]) -> int:
    if "--render-only" not in argv:
        started = time.monotonic()
        results = dict(zip((f"LoRA r=16 {size}" for size in SIZES), _plans(list(SIZES), *SIDES["LoRA r=16"])))
        *qlora, calibration = _plans([*SIZES, "80GB"], *SIDES["QLoRA r=32"])  # Unsloth's 80 GB: 80e9 bytes
        results.update(zip((f"QLoRA r=32 {size}" for size in SIZES), qlora))
        from ddp_patches import plan

        # last: it simulates in this process, after which the planner no longer forks (plan/planner.py's _map)
        calibration["unsloth_baseline"] = plan.baseline_row(CONFIG, calibration["budget"])
        data = {"results": results, "calibration": calibration}
        with open(DATA, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        print(f"tools.long_context: {len(SIZES)} sizes x 2 sides and the calibration planned in "
              f"{time.monotonic() - started:.0f} s")
    with open(DATA, encoding="utf-8") as f:
        render(json.load(f))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
