"""`sd2_tpool` merge of MoonViT-V2 (DESIGN §7): temporal mean pooling, then 2 x 2 spatial grouping.

L packed patches, D width, grid_thws [N, 3] as (t, h, w), kernel (kh, kw). Per image or video, as
the official `tpool_patch_merger` (moonshotai/Kimi-K3 `modeling_kimi_k3.py`): the [t, h, w, D]
patches are averaged over t, and each kh x kw window becomes one token of kh * kw patch vectors in
(row, column) order within the window; windows in raster order. The projector concatenates them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _ints(grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
    return grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else grid_thws


def merged_counts(grid_thws: torch.Tensor | Sequence[Sequence[int]], kernel: tuple[int, int] | list[int]) -> list[int]:
    """Merged tokens per image: (h / kh) * (w / kw), whatever t."""
    kh, kw = kernel
    return [(h // kh) * (w // kw) for _, h, w in _ints(grid_thws)]


def tpool_merge(x: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]],
                kernel: tuple[int, int] | list[int]) -> torch.Tensor:
    """x [L, D] -> [M, kh * kw, D], M = sum of merged_counts, images in order; grid_thws a tensor
    or (t, h, w) ints (then nothing is read back from the device)."""
    kh, kw = kernel
    d = x.shape[-1]
    out, start = [], 0
    for t, h, w in _ints(grid_thws):
        if h % kh or w % kw:  # the official view would fail; the image processor pads to the kernel
            raise ValueError(f"a {h} x {w} patch grid does not tile into {kh} x {kw} merge windows")
        seq = x[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, d)
        out.append(seq.permute(0, 1, 3, 2, 4, 5).mean(dim=0).reshape(-1, kh * kw, d))
        start += t * h * w
    if start != x.shape[0]:
        raise ValueError(f"{x.shape[0]} patches given, grid_thws describes {start}")
    return torch.cat(out)
