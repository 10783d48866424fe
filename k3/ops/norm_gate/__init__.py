"""KDA's output norm and gate (DESIGN §3): y = RMSNorm_K(o) * weight * sigmoid(gate), in fp32.

o and gate [..., K] (per head), weight [K]; the result is in o's dtype. Two interchangeable
backends, as for the short conv and the KDA op:
- "torch": `reference.py`, plain fp32 torch; every device.
- "fla":   fla's Triton `rms_norm_gated` on CUDA (`fla_backend.py`): one kernel forward and one
           backward, where the torch path makes about ten fp32 passes over [T, H*K] and keeps
           fp32 intermediates for autograd.
"auto" picks fla on CUDA when it imports, else torch.
"""
from __future__ import annotations

import torch

from k3.ops import fla_kernels
from k3.ops.norm_gate import fla_backend
from k3.ops.norm_gate.reference import rms_norm_gated_torch

IMPLS = ("auto", "torch", "fla")


def rms_norm_gated(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float,
                   impl: str = "auto") -> torch.Tensor:
    if impl not in IMPLS:
        raise ValueError(f"rms_norm_gated: impl must be one of {IMPLS}, got {impl!r}")
    if gate.shape != o.shape:
        raise ValueError(f"rms_norm_gated: gate must have o's shape {tuple(o.shape)}, got {tuple(gate.shape)}")
    if weight.shape != o.shape[-1:]:
        raise ValueError(f"rms_norm_gated: weight must be [{o.shape[-1]}], got {tuple(weight.shape)}")
    if impl == "auto":
        impl = "fla" if o.is_cuda and fla_kernels.available() else "torch"
    backend = fla_backend.rms_norm_gated_fla if impl == "fla" else rms_norm_gated_torch
    return backend(o, gate, weight, eps=eps)
