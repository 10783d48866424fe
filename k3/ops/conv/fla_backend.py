"""The causal short convolution on CUDA through fla's Triton `causal_conv1d` (fla-core 0.6.0,
fla/modules/causal_conv1d/ops.py), imported lazily; same contract as the reference (k3.ops.conv).

fla keeps a conv state of the last W inputs, [N, C, W], and reads only its last W-1 columns as
the left context; our tails are exactly those W-1 inputs, so a tail enters as the state with a
zero column in front and leaves as the state without its first column. The kernel accumulates in
fp32 (weights read as fp32) and applies the SiLU before its one rounding to x's dtype; the torch
path rounds the conv output first, a difference within bf16 rounding. fla's autograd function
gives gradients for x, the weight, the initial tails and through the final tails.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops import fla_kernels


def causal_conv1d_fla(x: torch.Tensor, weight: torch.Tensor, *, initial_state: torch.Tensor | None,
                      cu_seqlens: torch.Tensor | None, output_final_state: bool,
                      activation: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not x.is_cuda:
        raise ValueError(f"causal_conv1d impl 'fla' runs on CUDA tensors only, got device {x.device}")
    if not fla_kernels.available():
        raise RuntimeError("causal_conv1d impl 'fla' needs fla-core with triton (pip install 'k3[cuda]'); "
                           "use impl='torch' or 'auto' instead")
    from fla.modules.causal_conv1d import causal_conv1d

    state = None if initial_state is None else F.pad(initial_state.to(x.dtype), (1, 0))
    y, final = causal_conv1d(x, weight, initial_state=state, output_final_state=output_final_state,
                             activation=activation, backend="triton", cu_seqlens=cu_seqlens)
    return y, None if final is None else final[..., 1:]
