"""Never silently wrong: two checks before each optimizer step, through torch's global step pre-hook.

``unsynced``: the unsynchronised-gradient guard; ``replica_check``: the replica check (docs/guard.md).
"""
