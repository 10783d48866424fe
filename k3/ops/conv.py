"""Depthwise causal short convolution of KDA's q/k/v streams (SPEC §3), with carried tails.

B batch, T tokens, C channels, W kernel width, N sequences (B, or len(cu_seqlens) - 1).

    y[t, c] = sum_w weight[c, w] * x[t - (W-1) + w, c]        (x before the sequence = its tail)

The official checkpoints store `q_conv1d.weight` etc. as nn.Conv1d depthwise weights [C, 1, W]
(cross-correlation, last tap on the current token); pass them squeezed to [C, W]. No activation
here: the layer applies SiLU. A sequence's tail is its last W-1 INPUTS (pre-conv), preceded by the
tail it started with, so a sequence shorter than W-1 keeps part of its initial tail (zeros when
none): splitting a sequence anywhere and carrying the tail reproduces one pass exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.varlen import check_cu_seqlens, pack, seq_lengths, unpack


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [B, T, C], weight [C, W], initial_state [N, C, W-1] -> (y [B, T, C], final tails [N, C, W-1] | None)."""
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
    if cu_seqlens is None:
        lengths = torch.full((B,), T, dtype=torch.long, device=x.device)
        return _conv(x, weight, initial_state, lengths, output_final_state)
    lengths = torch.tensor(seq_lengths(cu_seqlens), dtype=torch.long, device=x.device)
    y, tails = _conv(unpack(x, cu_seqlens), weight, initial_state, lengths, output_final_state)
    return pack(y, cu_seqlens), tails


def _conv(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None,
          lengths: torch.Tensor, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, L, C] (sequence n real up to lengths[n], zero-padded after)."""
    N, L, C = x.shape
    W = weight.shape[1]
    head = x.new_zeros(N, C, W - 1) if initial_state is None else initial_state.to(x.dtype)
    xt = torch.cat([head, x.transpose(1, 2)], dim=2)  # [N, C, W-1+L]: tail, then the inputs
    y = F.conv1d(xt, weight.to(x.dtype).unsqueeze(1), groups=C).transpose(1, 2)  # [N, L, C]
    if not output_final_state:
        return y, None
    # The W-1 inputs just before each sequence's real end sit at xt[:, :, len : len+W-1].
    idx = lengths[:, None] + torch.arange(W - 1, device=x.device)
    return y, xt.gather(2, idx[:, None, :].expand(N, C, W - 1))
