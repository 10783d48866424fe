"""Packed variable-length batches: FlashAttention's `cu_seqlens` convention.

N sequences lie end to end along T of a [1, T, ...] tensor; `cu_seqlens` (int64 [N+1]) holds
their boundaries, 0 = cu[0] <= cu[1] <= ... <= cu[N] = T. An op that takes `cu_seqlens` treats
every sequence as if it ran alone: no token ever sees another sequence's tokens or state.

The CPU ops turn a packed batch into a zero-padded [N, T_max, ...] one (`unpack`) and back
(`pack`). Zero padding at the END of a sequence is inert for KDA (g = 0: no decay, beta = 0: no
write) and for the causal conv (outputs past the end are dropped, tails are gathered at each
sequence's real end), so padded positions never change a real output or a final state.

In host-free mode (k3.ops.host_free) `cu_seqlens` may end in zero-length documents (entries equal
to T) and nothing here reads its values on the host: `check_cu_seqlens` checks shapes only and
`token_documents` builds the per-token metadata on the device with fixed shapes.
"""
from __future__ import annotations

import itertools

import torch

from k3.ops import host_free


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, tokens: int) -> int:
    """Validate `cu_seqlens` for a [batch, tokens, ...] input; returns N, the number of sequences."""
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences along T and needs batch size 1, got B={batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be an integer tensor (int64), got {cu_seqlens.dtype}")
    if host_free.active():  # values are validated once per step where the batch is packed, off the graph
        return cu_seqlens.numel() - 1
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={tokens}, got {bounds[0]}..{bounds[-1]}")
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return len(bounds) - 1


def token_documents(cu_seqlens: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index [T], position in that document [T]) of every token, int64, on the device.
    A token belongs to the LAST document starting at or before it: zero-length documents (any
    run of equal entries, e.g. the padded tails) start where the next real one does, so none owns a token."""
    t = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens, t, right=True) - 1
    return doc.long(), (t - cu_seqlens[doc]).long()


def seq_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    return cu_seqlens.diff().tolist()


def longest_sequence(tokens: int, cu_seqlens: torch.Tensor | None) -> int:
    """Length of the longest sequence of a [B, tokens] batch, uniform or packed (1 = pure decode)."""
    return tokens if cu_seqlens is None else int(cu_seqlens.diff().max())


def _padded_positions(lengths: list[int], t_pad: int, device) -> torch.Tensor:
    """Row n*t_pad + i of an [N, t_pad] grid for every real token i < lengths[n], in packed order."""
    starts = torch.arange(len(lengths), device=device) * t_pad
    counts = torch.tensor(lengths, device=device)
    return torch.repeat_interleave(starts, counts) + (
        torch.arange(int(counts.sum()), device=device)
        - torch.repeat_interleave(counts.cumsum(0) - counts, counts))


def unpack(x: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    """[1, T, ...] packed -> [N, T_pad, ...] zero-padded, T_pad = max length rounded up to `multiple`."""
    lengths = seq_lengths(cu_seqlens)
    t_pad = -(-max(lengths) // multiple) * multiple
    if all(n == t_pad for n in lengths):  # equal windows (a training batch of whole windows): no copy
        return x.reshape(len(lengths), t_pad, *x.shape[2:]).contiguous()
    # one scatter into zeros, not a select per sequence: per-sequence slicing makes backward
    # zero-fill a whole [N, T_pad, ...] gradient once per sequence
    rows = _padded_positions(lengths, t_pad, x.device)
    out = x.new_zeros(len(lengths) * t_pad, *x.shape[2:]).index_copy(0, rows, x[0])
    return out.view(len(lengths), t_pad, *x.shape[2:])


def pack(y: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N, T_pad, ...] -> [1, T, ...]: the inverse of `unpack` (padding dropped)."""
    lengths = seq_lengths(cu_seqlens)
    N, t_pad = y.shape[:2]
    if all(n == t_pad for n in lengths):
        # contiguous, as the per-sequence cat was: a strided result (the conv's transposed output)
        # sends later products down another BLAS kernel, whose rounding batch-invariant mode pins
        return y.reshape(1, N * t_pad, *y.shape[2:]).contiguous()
    rows = _padded_positions(lengths, t_pad, y.device)
    return y.reshape(N * t_pad, *y.shape[2:]).index_select(0, rows).unsqueeze(0)
