"""``python -m tools.long_context``: the planner's long-context table of docs/benchmarks.md (Llama-3.1-8B, LoRA r=16
and QLoRA r=32, at 24, 48, 80 and 141 GiB, and Unsloth's baseline setup at 80 GB), written to
docs/data/plan-long-context.json and rendered between the block's markers (``--render-only``: from the JSON)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "data", "plan-long-context.json")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
SIDES = {"LoRA r=16": ["--lora-r", "16"], "QLoRA r=32": ["--qlora", "--lora-r", "32"]}
SIZES = ("24GiB", "48GiB", "80GiB", "141GiB")


def _plan(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ddp_patches", "plan", "--config",
                          os.path.join(ROOT, "tests", "data", "llama-3.1-8b"), "--json", *args],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


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
        results = {f"{side} {size}": _plan("--gpu-memory", size, *flags) for side, flags in SIDES.items()
                   for size in SIZES}
        data = {"results": results, "calibration": _plan("--gpu-memory", "80GB", *SIDES["QLoRA r=32"])}
        with open(DATA, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    with open(DATA, encoding="utf-8") as f:
        render(json.load(f))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
