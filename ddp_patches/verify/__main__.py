"""``python -m ddp_patches.verify``: the validation harness (the same as ``python -m ddp_patches validate``)."""

import sys

from .validate import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m ddp_patches.verify"))
