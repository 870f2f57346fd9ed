"""``python -m ddp_patches doctor [--json] [--tiled-mlp]``: versions, launch, what apply() changes, findings."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_patches")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="report versions, world size, what apply() changes, risky settings")
    doctor.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    doctor.add_argument("--tiled-mlp", action="store_true", help="include the tiled MLP in what apply() changes")
    args = parser.parse_args(argv)

    from .doctor import diagnose

    diagnosis = diagnose(tiled_mlp=args.tiled_mlp)
    sys.stdout.write((json.dumps(diagnosis.as_dict(), indent=2) if args.json else str(diagnosis)) + "\n")
    return 1 if any(f.severity == "error" for f in diagnosis.findings) else 0


if __name__ == "__main__":
    sys.exit(main())
