"""The causal short convolution in plain torch (contract in k3.ops.conv): the readable reference
and the CPU path. Packed sequences are unpacked to a zero-padded batch, each row prefixed with its
tail, convolved with F.conv1d (depthwise), and packed back; the final tails are gathered at each
sequence's real end."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.varlen import pack, seq_lengths, unpack


def causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, *, initial_state: torch.Tensor | None,
                        cu_seqlens: torch.Tensor | None, output_final_state: bool,
                        activation: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, T, _ = x.shape
    if cu_seqlens is None:
        lengths = torch.full((B,), T, dtype=torch.long, device=x.device)
        y, tails = _conv(x, weight, initial_state, lengths, output_final_state)
    else:
        lengths = torch.tensor(seq_lengths(cu_seqlens), dtype=torch.long, device=x.device)
        y, tails = _conv(unpack(x, cu_seqlens), weight, initial_state, lengths, output_final_state)
        y = pack(y, cu_seqlens)
    return (F.silu(y) if activation == "silu" else y), tails


def _conv(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None,
          lengths: torch.Tensor, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, L, C] (sequence n real up to lengths[n], zero-padded after)."""
    N, _L, C = x.shape
    W = weight.shape[1]
    head = x.new_zeros(N, C, W - 1) if initial_state is None else initial_state.to(x.dtype)
    xt = torch.cat([head, x.transpose(1, 2)], dim=2)  # [N, C, W-1+L]: tail, then the inputs
    y = F.conv1d(xt, weight.to(x.dtype).unsqueeze(1), groups=C).transpose(1, 2)  # [N, L, C]
    if not output_final_state:
        return y, None
    # The W-1 inputs just before each sequence's real end sit at xt[:, :, len : len+W-1].
    idx = lengths[:, None] + torch.arange(W - 1, device=x.device)
    return y, xt.gather(2, idx[:, None, :].expand(N, C, W - 1))
