"""``python -m benchmarks``: run every benchmark, write results/<name>.json and a PNG plot each, and (with
``--readme``) regenerate the results table of docs/benchmarks.md from the JSON files.

    python -m benchmarks                       # all (GPU ones are skipped with a message when there is no GPU)
    python -m benchmarks --quick               # shorter sweeps: a few minutes on a 2-core CPU machine
    python -m benchmarks --only ddp_overhead,scaling
    python -m benchmarks --readme-only         # rebuild the docs table from results/*.json, run nothing
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import provenance  # noqa: E402
from benchmarks._common import RESULTS, finish  # noqa: E402

BENCHMARKS = ("ddp_overhead", "tiled_mlp", "tiled_layer", "scaling", "offload", "max_seq", "guard")
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
HEADER = ["| benchmark | measured | target | status |", "|---|---|---|---|"]


def run_all(names: list[str], quick: bool, out_dir: str) -> dict[str, str]:
    outcome = {}
    for i, name in enumerate(names, 1):
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"[{i}/{len(names)}] {name}: running{' (quick)' if quick else ''}", flush=True)
        start = time.monotonic()
        try:
            report = module.run(quick)
        except RuntimeError as e:  # the ranks failed: report it and go on with the others
            print(f"    failed: {e}", flush=True)
            outcome[name] = "failed"
            continue
        if report is None:
            outcome[name] = "skipped"
            continue
        report["seconds"] = round(time.monotonic() - start, 1)
        finish(module, report, out_dir)
        outcome[name] = "ok"
    return outcome


def readme_table(results_dir: str) -> list[str]:
    lines = list(HEADER)
    for name in BENCHMARKS:
        path = os.path.join(results_dir, f"{name}.json")
        if not os.path.exists(path):
            lines.append(f"| {name} | not measured yet (`python -m benchmarks --only {name}`) | | |")
            continue
        with open(path) as f:
            report = json.load(f)
        module = importlib.import_module(f"benchmarks.{name}")
        mark = provenance.mark(f"benchmarks/results/{name}.json", report)
        lines += [_marked(row, mark) for row in module.summarize(report)]
    return lines


def _marked(row: str, mark: str) -> str:
    """A stale result's row says so in its status cell: shown, not hidden."""
    if not mark:
        return row
    head, status = row.rstrip().removesuffix("|").rsplit("|", 1)
    return f"{head}| {status.strip()}; **{mark}** |"


def update_readme(readme: str, table: list[str]) -> bool:
    with open(readme) as f:
        text = f.read()
    if START not in text or END not in text:
        print(f"{readme} has no {START} ... {END} block; table not written", file=sys.stderr)
        return False
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(head + START + "\n" + "\n".join(table) + "\n" + END + tail)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--quick", action="store_true", help="shorter sweeps")
    p.add_argument("--out-dir", default=RESULTS)
    p.add_argument("--readme", action="store_true", help="also rebuild the table of docs/benchmarks.md afterwards")
    p.add_argument("--readme-only", action="store_true", help="only rebuild the table of docs/benchmarks.md")
    p.add_argument("--readme-path", default=os.path.join(ROOT, "docs", "benchmarks.md"), help="the page to rewrite")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}", file=sys.stderr)
        return 2
    failed = False
    if not args.readme_only:
        outcome = run_all(names, args.quick, args.out_dir)
        print("summary: " + ", ".join(f"{k} {v}" for k, v in outcome.items()))
        failed = "failed" in outcome.values()
    if args.readme or args.readme_only:
        table = readme_table(args.out_dir)
        if update_readme(args.readme_path, table):
            print(f"{args.readme_path}: table rebuilt from {args.out_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
