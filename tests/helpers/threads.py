"""One intra-op thread for tests of tiny ops (import the fixture into a test module; it is autouse)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny ops are overhead-bound: a second thread only spin-waits, and on a shared 2-core machine
    contends with other work (measured 20x on k3-tiny decode under load); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
