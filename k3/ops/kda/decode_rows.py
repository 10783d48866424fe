"""Packed batches that mix one-token sequences with longer ones, on the torch paths.

A serving step packs the decode rows of running requests (one token each) with the prefill chunk
of a newly admitted one. `kda_chunk` alone would pad every sequence to the longest one, rounded up
to a whole chunk: each decode row would cost a chunk of 64 positions. Here the one-token sequences
run the recurrent step as one [n, 1] batch, the others run chunked among themselves, and outputs
and final states go back to their places. Both halves compute the same function (chunk =
recurrent, tests/test_kda_ops.py), so the split changes nothing but the cost.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from k3.ops.kda.chunk import kda_chunk
from k3.ops.kda.reference import kda_recurrent
from k3.ops.varlen import seq_lengths


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda_chunk` over a packed [1, T] batch, with its one-token sequences split off as above."""
    lengths = seq_lengths(cu_seqlens)
    single = [n for n, length in enumerate(lengths) if length == 1]
    multi = [n for n, length in enumerate(lengths) if length > 1]
    if not single or not multi:
        return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    starts = [0, *accumulate(lengths)][:-1]  # from the lengths already on the host: no second read
    single_pos = torch.tensor([starts[n] for n in single], device=q.device)
    multi_pos = torch.cat([torch.arange(starts[n], starts[n] + lengths[n], device=q.device) for n in multi])
    multi_cu = torch.tensor([0] + [lengths[n] for n in multi], device=cu_seqlens.device).cumsum(0)

    def state_of(rows: list[int]) -> torch.Tensor | None:
        return None if initial_state is None else initial_state[rows]

    inputs = (q, k, v, g, beta)
    o_single, s_single = kda_recurrent(*(t[0, single_pos].unsqueeze(1) for t in inputs), scale=scale,
                                       initial_state=state_of(single), output_final_state=True)
    o_multi, s_multi = kda_chunk(*(t[:, multi_pos] for t in inputs), scale=scale, initial_state=state_of(multi),
                                 output_final_state=True, cu_seqlens=multi_cu, chunk_size=chunk_size)
    o = o_multi.new_empty(*v.shape)
    o[0, single_pos] = o_single[:, 0]
    o[0, multi_pos] = o_multi[0]
    if not output_final_state:
        return o, None
    state = s_multi.new_empty(len(lengths), *s_multi.shape[1:])
    state[single] = s_single
    state[multi] = s_multi
    return o, state
