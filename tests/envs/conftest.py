"""Sandboxes for the tests, skipped (with the exact reason) on hosts where bwrap cannot run."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from k3.envs import Limits, Sandbox


@pytest.fixture
def make_sandbox(sandbox_support) -> Iterator:
    """make_sandbox(**limits) -> an open Sandbox, closed after the test."""
    made: list[Sandbox] = []

    def make(**limits) -> Sandbox:
        sandbox = Sandbox(Limits(**limits))
        made.append(sandbox)
        return sandbox

    yield make
    for sandbox in made:
        sandbox.close()
