"""KDA's output norm and gate on CUDA through fla's Triton `rms_norm_gated` (fla-core 0.6.0,
fla/modules/norm/fused_norm_gate.py), imported lazily; same contract as the reference.

With `activation="sigmoid"` and no bias the kernel computes x * rstd * weight * sigmoid(g), rstd =
1 / sqrt(mean(x^2) + eps), all in fp32 after loading, and rounds once to x's dtype: the reference's
formula and order. Its autograd function gives the gradients of o, the gate and the weight.
Excluded from torch.compile tracing (a graph break), as fla's KDA ops are.
"""
from __future__ import annotations

import torch

from k3.ops import fla_kernels


@torch.compiler.disable
def rms_norm_gated_fla(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    if not o.is_cuda:
        raise ValueError(f"rms_norm_gated impl 'fla' runs on CUDA tensors only, got device {o.device}")
    if not fla_kernels.available():
        raise RuntimeError("rms_norm_gated impl 'fla' needs fla-core with triton (pip install 'k3[cuda]'); "
                           "use impl='torch' or 'auto' instead")
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(o, gate.to(o.dtype), weight, None, activation="sigmoid", eps=eps)
