"""Packed batches that mix short sequences with longer ones, on the torch paths.

A serving step packs the decode rows of running requests (one token each, or a speculative
step's last token and its k drafts) with the prefill chunk of a newly admitted one. `kda_chunk`
alone would pad every sequence to the longest one, rounded up to a whole chunk: each decode row
would cost a chunk of 64 positions. Here the sequences of at most `SHORT` tokens run the recurrent
step as one zero-padded [n, longest] batch (padding at a sequence's end is inert: no decay, no
write), the others run chunked among themselves, and outputs and final states go back to their
places. Both halves compute the same function (chunk = recurrent, tests/test_kda_ops.py), so the
split changes nothing but the cost.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from k3.ops.kda.chunk import kda_chunk
from k3.ops.kda.inputs import check_kda_inputs
from k3.ops.kda.reference import kda_recurrent
from k3.ops.varlen import seq_lengths

# sequences this short run the recurrent step (a chunk would pad each to 64 positions)
SHORT = 16


def kda_split_decode_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    short_below: int = SHORT,
    decay_floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda_chunk` over a packed [1, T] batch, with its sequences of at most `short_below` tokens
    split off as above (a large `short_below`: every sequence token by token, in one batch).
    `decay_floor`: as `kda_chunk`'s."""
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    lengths = seq_lengths(cu_seqlens)
    # zero-length sequences (a captured step's padding) have no tokens: their state passes through
    empty = [n for n, length in enumerate(lengths) if length == 0]
    short = [n for n, length in enumerate(lengths) if 0 < length <= short_below]
    multi = [n for n, length in enumerate(lengths) if length > short_below]
    if not short and not empty:
        return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                         decay_floor=decay_floor)
    starts = [0, *accumulate(lengths)][:-1]  # from the lengths already on the host: no second read
    longest = max((lengths[n] for n in short), default=0)
    # [n, longest] gather indices of the short rows; padding slots read row 0 and are zeroed
    index = torch.tensor([[starts[n] + min(t, lengths[n] - 1) for t in range(longest)] for n in short],
                         device=q.device)
    real = torch.tensor([[t < lengths[n] for t in range(longest)] for n in short], device=q.device)

    def state_of(rows: list[int]) -> torch.Tensor | None:
        return None if initial_state is None else initial_state[rows]

    inputs = (q, k, v, g, beta)
    o = s_short = s_multi = None
    if short:
        padded = [t[0, index] * real.view(*real.shape, *([1] * (t.dim() - 2))).to(t.dtype) for t in inputs]
        o_short, s_short = kda_recurrent(*padded, scale=scale, initial_state=state_of(short),
                                         output_final_state=True)
        o = o_short.new_zeros(*v.shape)
        o[0, index[real]] = o_short[real]
    if multi:
        multi_pos = torch.cat([torch.arange(starts[n], starts[n] + lengths[n], device=q.device) for n in multi])
        multi_cu = torch.tensor([0] + [lengths[n] for n in multi], device=cu_seqlens.device).cumsum(0)
        o_multi, s_multi = kda_chunk(*(t[:, multi_pos] for t in inputs), scale=scale, initial_state=state_of(multi),
                                     output_final_state=True, cu_seqlens=multi_cu, chunk_size=chunk_size,
                                     decay_floor=decay_floor)
        o = o_multi.new_zeros(*v.shape) if o is None else o
        o[0, multi_pos] = o_multi[0]
    if o is None:  # no tokens at all
        o = v.new_zeros(v.shape)
    if not output_final_state:
        return o, None
    state = q.new_zeros(len(lengths), q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    if initial_state is not None:
        state[empty] = initial_state[empty].to(state.dtype)
    if short:
        state = state.to(s_short.dtype)
        state[short] = s_short
    if multi:
        state[multi] = s_multi.to(state.dtype)
    return o, state
