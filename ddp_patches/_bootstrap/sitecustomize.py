"""Start-up hook of ``ddp-patches-run`` (ddp_patches/autoapply.py): apply() once torch is imported.

This directory is put first on PYTHONPATH only by ``ddp-patches-run``; the user's own sitecustomize, further on
the path, is imported right after.
"""

import sys

from ddp_patches import autoapply

try:
    autoapply.bootstrap()
finally:
    autoapply.chain_user_sitecustomize(sys.modules[__name__])
