"""Helpers shared by the tests: one relative-error comparison (fla's habit), fixture paths, and
small models, inputs and training settings (tests.helpers.models / kda / train)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
K3_CONFIG_JSON = FIXTURES / "moonshotai-Kimi-K3.config.json"
KIMI_LINEAR_CONFIG_JSON = FIXTURES / "moonshotai-Kimi-Linear-48B-A3B.config.json"


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMSE(ref - out) / RMSE(ref), in fp64."""
    ref, out = ref.detach().double(), out.detach().double()
    return ((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def recompile_limit_hits(caplog: pytest.LogCaptureFixture) -> list[str]:
    """dynamo's warnings that a compiled function ran out of recompiles (it then runs eager)."""
    return [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()]


def assert_rel_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values in output"
    err = rel_err(ref, out)
    diff = (ref.double() - out.double()).abs().max().item()
    assert err <= ratio, f"{name}: rel err {err:.3e} > {ratio:.1e} (max abs diff {diff:.3e})"
