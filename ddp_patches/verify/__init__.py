"""Verification helpers shared by the validation harness (``validate.py``) and the tests: model builders and the
parity loop.

Nothing here is imported by ``import ddp_patches``; it pulls in transformers/peft only when a builder needs them.
"""
