"""One intra-op thread for the vision tests: the per-image attention loop over tiny images is
overhead-bound, and extra threads only contend with other work on a 2-core machine."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
