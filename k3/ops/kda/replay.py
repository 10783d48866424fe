"""Replay: a KDA layer's state after a prefix of recorded tokens, from the state before them
(DESIGN §11, speculative decoding's rollback).

A verification forward runs a sequence's last token and its k drafted tokens and leaves the state
after all of them; when only a tokens are accepted, the state must be the one after 1 + a tokens.
Instead of a state per position ([N, H, K, V] fp32 each: K3 ~6 MB per layer and sequence), the
forward keeps the per-token inputs (`k3.model.cache.KDAInputs`) and the state before it (the
request's state pages), and this module advances that state over the accepted prefix only:

- conv tails: the last W-1 pre-conv inputs of (old tail ++ accepted tokens' conv inputs);
- recurrence: the KDA op itself over the accepted tokens (its `recurrent` reference on CPU, fla's
  kernels on CUDA), so the replayed state is the op's own arithmetic on the same inputs.

`replay_tails_reference` is the readable per-sequence form of `replay_tails`.
"""
from __future__ import annotations

import torch


def replay_tails(tails: torch.Tensor, conv_inputs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """tails [N, C, W-1] (before the tokens), conv_inputs [1, T, C] packed by cu_seqlens [N+1]
    -> the tails after each sequence's tokens [N, C, W-1] (tails' dtype); one gather for all."""
    N, C, Wm1 = tails.shape
    lengths = cu_seqlens.diff().to(tails.device)
    longest = int(lengths.max()) if N else 0
    # [N, C, W-1 + longest]: the old tail, then each sequence's inputs left-aligned, zero-padded
    padded = conv_inputs.new_zeros(N, longest, C)
    rows = torch.arange(longest, device=tails.device)
    valid = rows[None, :] < lengths[:, None]
    padded[valid] = conv_inputs[0].to(padded.dtype)
    window = torch.cat([tails, padded.transpose(1, 2).to(tails.dtype)], dim=2)
    columns = lengths[:, None] + torch.arange(Wm1, device=tails.device)[None, :]  # the last W-1 real columns
    return window.gather(2, columns[:, None, :].expand(N, C, Wm1))


def replay_tails_reference(tails: torch.Tensor, conv_inputs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    out, bounds = [], cu_seqlens.tolist()
    Wm1 = tails.shape[-1]
    for n in range(tails.shape[0]):
        seq = conv_inputs[0, bounds[n]:bounds[n + 1]].t().to(tails.dtype)
        out.append(torch.cat([tails[n], seq], dim=1)[:, -Wm1:] if Wm1 else tails[n])
    return torch.stack(out)
