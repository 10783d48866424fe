"""RMS normalization without a weight, the formula every RMSNorm in k3 shares (SPEC §3-5)."""
from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in x's dtype (callers pass fp32)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
