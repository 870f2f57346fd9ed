"""PyTorch's own DDP tests, shipped in the wheel, driven as upstream's test/distributed/test_distributed_spawn.py.

Run with BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=<dir> INIT_METHOD=file://<dir>/init (with ``env://`` the harness
rewrites the address before spawning and the class fails to load in the child). tests/test_upstream.py runs
it through ``ddp-patches-run`` so every spawned rank is patched.
"""

from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
