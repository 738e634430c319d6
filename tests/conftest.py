"""Shared test setup: keep torch to one thread per process on the 2-core CI machine, and
skip tests marked slow unless DISTTRAIN_SLOW=1 or `-m slow` asks for them."""

import os

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DISTTRAIN_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with DISTTRAIN_SLOW=1 or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
