"""The causal short convolution of a packed row without reading its boundaries on the host
(host-free mode, k3.ops.host_free; contract in k3.ops.conv): W shifted copies of the whole row,
each tap masked where it would reach across a document start, summed in fp32.

    y[t] = act(sum_j weight[:, W-1-j] * x[t-j] * (pos[t] >= j))     pos: t's index in its document

No initial tails and no final tails (a training forward needs neither); every shape is fixed by
T, so one captured graph serves any document boundaries. Like fla's kernel it accumulates and
applies the activation in fp32 and rounds once to x's dtype; autograd gives the backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.varlen import token_documents


def causal_conv1d_masked(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         activation: str | None) -> torch.Tensor:
    """x [1, T, C] packed by cu_seqlens, weight [C, W] -> y [1, T, C] in x's dtype."""
    T, W = x.shape[1], weight.shape[1]
    _, pos = token_documents(cu_seqlens, T)
    xp = F.pad(x.float(), (0, 0, W - 1, 0))  # W-1 zero rows before the row: tap j of token t is xp[t + W-1-j]
    w = weight.float()
    y = xp[:, W - 1:] * w[:, W - 1]  # tap 0, the token itself, never crosses a start
    for j in range(1, W):
        y = y + xp[:, W - 1 - j:W - 1 - j + T] * w[:, W - 1 - j] * (pos >= j)[None, :, None]
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)
