"""Normalizations (DESIGN §3-5). B batch, T tokens, D width.

RMSNorm normalizes in fp32, casts back to the input dtype, then applies the weight in that dtype,
in this order as the official Kimi-Linear/DeepSeek RMSNorm does (`weight * x.to(input_dtype)`), so
bf16 outputs match it to the bit. The MLA latent norms' eps (1e-6) differs from everything else
(1e-5, `rms_norm_eps`), so eps is always explicit.
"""
from __future__ import annotations

import torch
from torch import nn

from k3.ops.rms_norm import rms_normalize


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        return self.weight.to(dtype) * rms_normalize(x.float(), self.eps).to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
