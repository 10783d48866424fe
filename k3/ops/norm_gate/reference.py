"""The readable reference of KDA's output norm and gate (k3.ops.norm_gate), in the official order:
normalize in fp32, multiply the norm weight, then the sigmoid gate (DESIGN §3; transformers
KimiLinearRMSNormGated)."""
from __future__ import annotations

import torch

from k3.ops.rms_norm import rms_normalize


def rms_norm_gated_torch(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    y = rms_normalize(o.float(), eps) * weight.float() * torch.sigmoid(gate.float())
    return y.to(o.dtype)
