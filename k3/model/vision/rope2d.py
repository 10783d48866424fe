"""2-D rotary position embedding of MoonViT-V2 (DESIGN §7), shared by all blocks and heads.

L packed patches, H heads, K head dim (qkv_hidden_size / heads), grid_thws [N, 3] as (t, h, w).
As the official `Rope2DPosEmbRepeated` (moonshotai/Kimi-K3 `modeling_kimi_k3.py`): head dims pair
up as complex numbers (x[2c], x[2c+1]), c < K/2; pair c = 2i turns by col * f_i and pair c = 2i + 1
by row * f_i, f_i = theta^(-4i / K), i < K/4; every frame of a video repeats its frame-0 angles.
Angles and the rotation are fp32, the result cast back to q/k's dtype. (transformers' Kimi-K2.5
port pairs x[c] with x[c + K/2] instead, on checkpoints whose q/k rows it permutes to match.)
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_GRID = 512  # the official table is 512 x 512 patches and asserts every image fits in it


def rope_angles(grid_thws: torch.Tensor | Sequence[Sequence[int]], head_dim: int, theta: float = 10000.0,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [L, K/2] fp32, for the packed patches of grid_thws (a tensor, or (t, h, w) ints)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32) / head_dim))
    rows, cols = [], []
    for t, h, w in (grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else grid_thws):
        if not (1 <= h <= MAX_GRID and 1 <= w <= MAX_GRID):
            raise ValueError(f"a {h} x {w} patch grid is outside the {MAX_GRID} x {MAX_GRID} rotary table")
        flat = torch.arange(h * w, device=device, dtype=torch.float32)
        rows.append((flat // w).repeat(t))
        cols.append((flat % w).repeat(t))
    row, col = torch.cat(rows), torch.cat(cols)
    # [L, K/4, 2] -> [L, K/2]: column angle then row angle for each frequency
    angles = torch.stack([col[:, None] * freqs, row[:, None] * freqs], dim=-1).flatten(1)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, H, K] rotated pairwise by (cos, sin) [L, K/2], in fp32; returns x's dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    re, im = xf.unbind(-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([re * c - im * s, re * s + im * c], dim=-1).flatten(-2).to(x.dtype)
