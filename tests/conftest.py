import importlib.util
import os
import sys

import pytest

from tests.harness import DistPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """A test marked ``deepspeed`` skips with the reason where deepspeed is not installed, before it runs anything
    (the README's install leaves it out: it builds from source)."""
    if importlib.util.find_spec("deepspeed") is not None:
        return
    skip = pytest.mark.skip(reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation "
                                   "deepspeed==0.19.8)")
    for item in items:
        if item.get_closest_marker("deepspeed"):
            item.add_marker(skip)


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
