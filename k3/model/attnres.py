"""Block Attention Residuals (SPEC §5, arXiv 2603.15031). S sources, B batch, T tokens, D width.

Instead of summing every sublayer's output into one residual stream, the model keeps the
embedding and one running sum per finished block of `attn_res_block_size` layers, and each
sublayer (and the final read) takes a softmax-weighted mix of those sources plus the running
partial sum of the current block. Scores use RMS-normalized sources against a learned
pseudo-query (`*_res_proj`, zero-initialized so every read starts as the uniform average) times
the norm weight (`*_res_norm.weight`), with no 1/sqrt(d). All in fp32 (SPEC §5).
"""
from __future__ import annotations

import torch
from torch import nn

from k3.model.norm import RMSNorm
from k3.ops.rms_norm import rms_normalize


class BlockSource:
    """A finished block: its value and its RMS-normalized key (computed once, read many times)."""

    __slots__ = ("value", "key")

    def __init__(self, value: torch.Tensor, eps: float):
        self.value = value.float()
        self.key = rms_normalize(self.value, eps)


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
    keys = [b.key for b in blocks] + [rms_normalize(prefix32, norm.eps)]
    values = [b.value for b in blocks] + [prefix32]
    scores = torch.stack([k @ query for k in keys], dim=0)  # [S, B, T]
    alpha = torch.softmax(scores, dim=0)
    out = alpha[0].unsqueeze(-1) * values[0]
    for s in range(1, len(values)):
        out = out + alpha[s].unsqueeze(-1) * values[s]
    return out.to(prefix.dtype)
