"""Repository maintenance: the generators of docs/ and the version lanes. Not shipped in the wheel.

Run from the repository root (``python -m tools.lanes``, ``python -m tools.compat``, ...): they read and write
docs/, tests/ and .ci/ of a checkout. They may import ``ddp_patches.verify`` (the validation harness).
"""
