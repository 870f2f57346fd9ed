"""``python -m ddp_patches doctor [--json] [--tiled-mlp]``: versions, launch, what apply() changes, findings.

``python -m ddp_patches validate [--list] [--scenarios ...]``: every scenario on 2 ranks, unpatched and patched
(ddp_patches/verify/validate.py; ``python validate_ddp_fix.py`` in a checkout).

``python -m ddp_patches plan --config PATH [--gpu-memory 80GiB] [--lora-r 16] [--seq N] [--batch 1] [--qlora]
[--host-memory 1TiB] [--gpus-per-node 8] [--exact] [--json]``: the longest sequence each setup trains on one GPU,
simulated (ddp_patches/plan/).
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddp_patches")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("validate", help="run every scenario unpatched and patched on 2 ranks (--help for options)")
    doctor = sub.add_parser("doctor", help="report versions, world size, what apply() changes, risky settings")
    doctor.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    doctor.add_argument("--tiled-mlp", action="store_true", help="include the tiled MLP in what apply() changes")
    plan = sub.add_parser("plan", help="simulate the longest sequence each setup trains on one GPU (no GPU needed)")
    plan.add_argument("--config", required=True, help="a local config.json or model folder (nothing is downloaded)")
    plan.add_argument("--gpu-memory", default="80GiB", help="one GPU's memory, e.g. 80GiB, 141GB (default 80GiB)")
    plan.add_argument("--lora-r", type=int, default=16, help="LoRA rank on every linear layer (default 16)")
    plan.add_argument("--seq", type=int, help="also say whether this many tokens fit, per setup")
    plan.add_argument("--batch", type=int, default=1, help="sequences per step (tokens = batch x seq; default 1)")
    plan.add_argument("--qlora", action="store_true",
                      help="QLoRA: the base linear weights in 4-bit NF4 (bitsandbytes), counted analytically")
    plan.add_argument("--host-memory", help="the node's host memory, e.g. 1TiB: caps what offload may pin per GPU "
                                            "(default: not capped; each offload row names what it needs)")
    plan.add_argument("--gpus-per-node", type=int, default=8,
                      help="GPUs (ranks) sharing that host memory (LOCAL_WORLD_SIZE; default 8)")
    plan.add_argument("--exact", action="store_true",
                      help="search by full simulations to 1024 tokens (minutes) instead of a fitted line and checks")
    plan.add_argument("--jobs", type=int, help="processes for the setups (default: 2 where there are 2 CPUs)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from . import plan as planner

    try:
        planner.check_arguments(args)
        return planner.main(args)
    except (ValueError, OSError, ImportError) as e:  # a flag, a config or a budget it cannot plan for
        parser.error(_one_line(e))


def _doctor(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .doctor import check_launch_environment, diagnose

    try:
        check_launch_environment()
    except ValueError as e:
        parser.error(_one_line(e))
    diagnosis = diagnose(tiled_mlp=args.tiled_mlp)
    sys.stdout.write((json.dumps(diagnosis.as_dict(), indent=2) if args.json else str(diagnosis)) + "\n")
    return 1 if any(f.severity == "error" for f in diagnosis.findings) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate"]:  # its own parser: every option after the word is the harness's
        from .verify.validate import main as validate

        return validate(argv[1:], prog="python -m ddp_patches validate")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _plan(parser, args)
    return _doctor(parser, args)


if __name__ == "__main__":
    sys.exit(main())
