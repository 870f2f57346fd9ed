"""Run a script unchanged (``python to_the_end.py SCRIPT ARGS...``), then print one line per rank once its
``__main__`` has returned: the evidence that a rank which died afterwards died at interpreter exit, not in the test."""

import os
import runpy
import sys

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    print(f"SCRIPT RETURNED on rank {os.environ.get('RANK', '-')}", flush=True)
