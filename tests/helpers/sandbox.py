"""The sandbox fixture: tests that need bubblewrap skip, with the exact reason, where it cannot run."""
from __future__ import annotations

import pytest

from k3.envs import Sandbox, SandboxError


@pytest.fixture(scope="session")
def sandbox_support() -> None:
    try:
        Sandbox().close()
    except SandboxError as e:
        pytest.skip(f"no sandbox on this host: {e}")
