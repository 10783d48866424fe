"""Depthwise causal short convolution of KDA's q/k/v streams (DESIGN §3), with carried tails.

B batch, T tokens, C channels, W kernel width, N sequences (B, or len(cu_seqlens) - 1).

    y[t, c] = act(sum_w weight[c, w] * x[t - (W-1) + w, c])   (x before the sequence = its tail)

The official checkpoints store `q_conv1d.weight` etc. as nn.Conv1d depthwise weights [C, 1, W]
(cross-correlation, last tap on the current token); pass them squeezed to [C, W]. `activation`
is None or "silu" (the KDA layer's; fused into fla's kernel). A sequence's tail is its last W-1
INPUTS (pre-conv), preceded by the tail it started with, so a sequence shorter than W-1 keeps part
of its initial tail (zeros when none): splitting a sequence anywhere and carrying the tail
reproduces one pass exactly.

Two interchangeable backends, as for the KDA op (k3.ops.kda):
- "torch": `reference.py`, F.conv1d over the tail-prefixed input; every device.
- "fla":   fla's Triton causal_conv1d on CUDA (`fla_backend.py`), forward and backward in one
           kernel each with the activation fused; cuDNN's depthwise conv backward is slow at long T.
"auto" picks fla on CUDA when it imports, else torch.
In host-free mode (k3.ops.host_free) a packed row takes `masked.py` whatever `impl`, on every
device (fla's kernel and the reference size their work from the lengths read on the host), tails
in and out included (a captured serving prefill): `initial_state` then has one tail per entry of
the fixed-length `cu_seqlens`, and a zero-length document returns its tail unchanged.
"""
from __future__ import annotations

import torch

from k3.ops import fla_kernels, host_free
from k3.ops.conv import fla_backend
from k3.ops.conv.masked import causal_conv1d_masked
from k3.ops.conv.reference import causal_conv1d_torch
from k3.ops.varlen import check_cu_seqlens

IMPLS = ("auto", "torch", "fla")
ACTIVATIONS = (None, "silu")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [B, T, C], weight [C, W], initial_state [N, C, W-1] -> (y [B, T, C], final tails [N, C, W-1] | None)."""
    if impl not in IMPLS:
        raise ValueError(f"causal_conv1d: impl must be one of {IMPLS}, got {impl!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"causal_conv1d: weight must be [C={C}, W], got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None and tuple(initial_state.shape) != (N, C, W - 1):
        raise ValueError(f"causal_conv1d: initial_state must be [N={N}, C={C}, W-1={W - 1}], "
                         f"got shape {tuple(initial_state.shape)}")
    if cu_seqlens is not None and host_free.active():
        return causal_conv1d_masked(x, weight, cu_seqlens, activation, initial_state, output_final_state)
    if impl == "auto":
        impl = "fla" if x.is_cuda and fla_kernels.available() else "torch"
    backend = fla_backend.causal_conv1d_fla if impl == "fla" else causal_conv1d_torch
    return backend(x, weight, initial_state=initial_state, cu_seqlens=cu_seqlens,
                   output_final_state=output_final_state, activation=activation)


__all__ = ["IMPLS", "causal_conv1d"]
