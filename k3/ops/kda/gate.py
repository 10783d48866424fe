"""The KDA forget gate (DESIGN §3): raw gate projections -> per-key-channel log-decay g, in fp32.

    K3 (lower_bound lb):  g = lb * sigmoid(exp(A_log) * (raw + dt_bias))   in (lb, 0)
    Kimi Linear:          g = -exp(A_log) * softplus(raw + dt_bias)         in (-inf, 0)

`activate_gate` is the readable reference; the torch KDA paths run it before the op. fla's kernels
compute the same expressions inside `chunk_kda` / `fused_recurrent_kda` (`use_gate_in_kernel`,
fla-core 0.6.0 `fla/ops/kda/gate.py`: the lower-bounded form when `lower_bound` is set, softplus
otherwise), so on CUDA the fp32 gate is never written to memory, and its backward (into raw,
A_log and dt_bias) comes from the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecayGate:
    A_log: torch.Tensor  # H values (K3 stores [H], Kimi Linear [1, 1, H, 1]), fp32
    dt_bias: torch.Tensor  # [H * K], fp32
    lower_bound: float | None  # None: the softplus form


def activate_gate(raw: torch.Tensor, gate: DecayGate) -> torch.Tensor:
    """raw [B, T, H, K] (any float dtype) -> g [B, T, H, K] fp32, g < 0."""
    H, K = raw.shape[-2:]
    z = raw.float() + gate.dt_bias.float().view(H, K)
    rate = gate.A_log.float().reshape(H, 1).exp()
    if gate.lower_bound is not None:
        return gate.lower_bound * torch.sigmoid(rate * z)
    return -rate * F.softplus(z)
