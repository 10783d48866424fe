"""The causal short convolution of a packed row without reading its boundaries on the host
(host-free mode, k3.ops.host_free; contract in k3.ops.conv): W shifted copies of the whole row,
each tap masked where it would reach across a document start, summed in fp32.

    y[t] = act(sum_j weight[:, W-1-j] * x[t-j] * (pos[t] >= j))     pos: t's index in its document

With carried tails (a serving prefill continuing cached sequences) a tap that reaches before its
document's start reads the document's initial tail instead, and the final tails are gathered from
the same stream (tails, then the row); every index is built on the device from `token_documents`
and `cu_seqlens`, every shape is fixed by T, N and W, so one captured graph serves any document
boundaries, zero-length documents (which keep their tail) included. Like fla's kernel it
accumulates and applies the activation in fp32 and rounds once to x's dtype; autograd gives the
backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.varlen import token_documents


def causal_conv1d_masked(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         activation: str | None, initial_state: torch.Tensor | None = None,
                         output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [1, T, C] packed by cu_seqlens [N+1], weight [C, W], initial_state [N, C, W-1] | None
    -> (y [1, T, C], final tails [N, C, W-1] | None), both in x's dtype."""
    if initial_state is None and not output_final_state:
        y = _conv_no_tails(x, weight, cu_seqlens)
        return (F.silu(y) if activation == "silu" else y).to(x.dtype), None
    T, C, W = x.shape[1], x.shape[2], weight.shape[1]
    N = cu_seqlens.numel() - 1
    doc, pos = token_documents(cu_seqlens, T)
    tails = x.new_zeros(N, C, W - 1) if initial_state is None else initial_state.to(x.dtype)
    # one stream: row n*(W-1) + i is tail n's column i, row N*(W-1) + t is token t
    stream = torch.cat([tails.transpose(1, 2).reshape(N * (W - 1), C), x[0]]).float()
    t = torch.arange(T, device=x.device)
    w = weight.float()
    y = x[0].float() * w[:, W - 1]  # tap 0, the token itself, never crosses a start
    for j in range(1, W):
        src = torch.where(pos >= j, N * (W - 1) + t - j, doc * (W - 1) + W - 1 - j + pos)
        y = y + stream.index_select(0, src) * w[:, W - 1 - j]
    y = (F.silu(y) if activation == "silu" else y).to(x.dtype)[None]
    if not output_final_state:
        return y, None
    # column i of document n's final tail: position p = len - (W-1) + i of its stream (tail, then its tokens)
    lengths = cu_seqlens.diff().long()
    p = lengths[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)
    n = torch.arange(N, device=x.device)[:, None]
    src = torch.where(p >= 0, N * (W - 1) + cu_seqlens[:-1, None].long() + p, n * (W - 1) + W - 1 + p)
    final = stream.index_select(0, src.reshape(-1)).view(N, W - 1, C).transpose(1, 2)
    return y, final.to(x.dtype)


def _conv_no_tails(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A training row: shifted copies of x, no gathers (fp32, before the activation)."""
    T, W = x.shape[1], weight.shape[1]
    _, pos = token_documents(cu_seqlens, T)
    xp = F.pad(x.float(), (0, 0, W - 1, 0))  # W-1 zero rows before the row: tap j of token t is xp[t + W-1-j]
    w = weight.float()
    y = xp[:, W - 1:] * w[:, W - 1]
    for j in range(1, W):
        y = y + xp[:, W - 1 - j:W - 1 - j + T] * w[:, W - 1 - j] * (pos >= j)[None, :, None]
    return y
