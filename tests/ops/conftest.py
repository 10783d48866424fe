"""Op tests: every fresh `torch.empty` / `torch.empty_like` float buffer starts as NaN, so an output
element an op forgets to write fails the comparison instead of passing as whatever memory held
(fla's conftest habit)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._device import _device_constructors

# `with torch.device(...)` looks factories up in a set cached on first use: built while torch.empty is
# patched, it would hold the patch, and every later `with torch.device("meta")` would allocate on the CPU
_device_constructors()


def _poisoned(factory):
    def make(*args, **kwargs):
        out = factory(*args, **kwargs)
        if out.is_floating_point() or out.is_complex():
            out.fill_(float("nan"))
        return out
    return make


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
