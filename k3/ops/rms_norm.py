"""RMS normalization without a weight, the formula every RMSNorm in k3 shares (DESIGN §3-5)."""
from __future__ import annotations

import torch


def rms_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, kept as a size-1 dim, in x's dtype."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in x's dtype (callers pass fp32)."""
    return x * rms_rstd(x, eps)
