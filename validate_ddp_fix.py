"""Prove the fix in one command, from a checkout: ``python validate_ddp_fix.py [--list] [--scenarios ...]``.

The harness lives in the package (``ddp_patches/verify/validate.py``; installed: ``python -m ddp_patches validate``).
Under ``torchrun --nproc_per_node=N validate_ddp_fix.py`` rank 0 drives and runs each scenario on N ranks.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this checkout's ddp_patches, installed or not

from ddp_patches.verify.validate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="validate_ddp_fix.py"))
