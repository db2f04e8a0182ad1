"""Test settings: one torch thread per process, offline hubs, hypothesis profiles, and the slow
tests left out unless ``-m`` names them (so ``-m "not spawns"`` leaves them out too)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

# The default run is derandomized, so CI is reproducible; "thorough" explores afresh.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=60,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", deadline=None, max_examples=1000, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests marked ``slow`` unless the ``-m`` expression mentions ``slow``."""
    if "slow" in config.getoption("markexpr", ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
