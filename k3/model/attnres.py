"""Block Attention Residuals (DESIGN §5, arXiv 2603.15031). S sources, B batch, T tokens, D width.

Instead of summing every sublayer's output into one residual stream, the model keeps the
embedding and one running sum per finished block of `attn_res_block_size` layers, and each
sublayer (and the final read) takes a softmax-weighted mix of those sources plus the running
partial sum of the current block. Scores use RMS-normalized sources against a learned
pseudo-query (`*_res_proj`, zero-initialized so every read starts as the uniform average) times
the norm weight (`*_res_norm.weight`), with no 1/sqrt(d). All in fp32 (DESIGN §5).

A source's normalized key is never materialized: RMSNorm(V) . (w * q) = rstd(V) * (V . (w * q)),
so a finished block keeps only its value and its per-token rstd ([B, T, 1]). A [B, T, D] fp32 key
per block would be as large as the value itself, read by every later read and kept for backward.
"""
from __future__ import annotations

import torch
from torch import nn

from k3.model.norm import RMSNorm
from k3.ops.rms_norm import rms_rstd


class BlockSource:
    """A finished block: its fp32 value and the value's per-token RMS rstd (computed once, read by
    every later read)."""

    __slots__ = ("rstd", "value")

    def __init__(self, value: torch.Tensor, eps: float):
        self.value = value.float()
        self.rstd = rms_rstd(self.value, eps)


def new_attn_res_pair(dim: int, eps: float) -> tuple[nn.Linear, RMSNorm]:
    """A read's `proj` (pseudo-query [1, D], zero init) and `norm`; the owning module registers them
    under the official names (`self_attention_res_proj`, `self_attention_res_norm`, ...)."""
    proj = nn.Linear(dim, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return proj, RMSNorm(dim, eps)


def attn_res_read(prefix: torch.Tensor, blocks: list[BlockSource], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """ATTNRES(prefix, blocks): sources = [blocks..., prefix]; returns sum_s softmax(score)_s V_s."""
    query = (norm.weight.float() * proj.weight.float()[0])  # [D]
    prefix32 = prefix.float()
    values = [b.value for b in blocks] + [prefix32]
    rstds = [b.rstd for b in blocks] + [rms_rstd(prefix32, norm.eps)]
    scores = torch.stack([(v @ query) * r.squeeze(-1) for v, r in zip(values, rstds)], dim=0)  # [S, B, T]
    alpha = torch.softmax(scores, dim=0)
    out = alpha[0].unsqueeze(-1) * values[0]
    for s in range(1, len(values)):
        out = out + alpha[s].unsqueeze(-1) * values[s]
    return out.to(prefix.dtype)
