import os
import sys

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


@pytest.fixture(autouse=True)
def _no_hf_deepspeed_config_left():
    """transformers keeps the last DeepSpeed config of a ``TrainingArguments(deepspeed=...)`` in a module global,
    also a half-built one when that raised (deepspeed missing): unset it after each test, as transformers' own
    tests do, so no later test's apply() sees a ZeRO-3 or broken config it did not make."""
    yield
    integration = sys.modules.get("transformers.integrations.deepspeed")
    if integration is not None:
        integration.unset_hf_deepspeed_config()
