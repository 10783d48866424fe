"""Fixtures for every test: a fixed seed; `gpu`-marked tests skip without CUDA (select them with
`-m gpu`; the default run deselects them). Helpers live in tests/helpers (importable, not conftest)."""
from __future__ import annotations

import pytest
import torch

pytest_plugins = ["tests.helpers.sandbox"]  # sandbox_support: tests that need bubblewrap skip where it cannot run


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_cuda)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
