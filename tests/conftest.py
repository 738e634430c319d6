"""Shared test setup: keep torch to one thread per process on the 2-core CI machine,
skip tests marked slow unless DISTTRAIN_SLOW=1 or `-m slow` asks for them, and re-read
disttrain's settings around each test (a test that sets a DISTTRAIN_* variable calls
`disttrain.settings.refresh()` itself; this undoes it once monkeypatch has)."""

import os

import pytest
import torch

from disttrain import settings

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_settings():
    """NOTE: requests no monkeypatch, so its teardown runs after monkeypatch's undo."""
    settings.refresh()
    yield
    settings.refresh()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DISTTRAIN_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with DISTTRAIN_SLOW=1 or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
