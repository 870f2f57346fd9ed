import os

import pytest

from tests.harness import DistPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def pool():
    """Two gloo ranks shared by every DDP test of the session."""
    p = DistPool(world_size=2)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _revert_after_each_test():
    """A failing test must not leave patches behind for the next one."""
    import ddp_patches

    yield
    ddp_patches.revert()
