"""Never silently wrong: two checks before each optimizer step, through torch's global step pre-hook.

The unsynchronised-gradient guard announces a step about to apply gradients DDP never averaged (a loss through
``.module``): one WARNING per rank, or ``UnsynchronizedGradientsError`` with ``on_unsynced="raise"``. The replica
check (``replica_check``) compares the ranks' parameters before steps 1, 2 and every ``replica_check_every``-th.
Both act only for DDPs built under apply() in a distributed process (NOTE [Engines]). ``unsynced`` tracks each
DDP; ``steps`` holds the optimizer step hooks and ``install``.
"""
