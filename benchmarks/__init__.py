"""Benchmarks: scripts that measure two configurations side by side in one run and print ratios."""
