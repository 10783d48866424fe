"""The packed images' layout for the tower (DESIGN §7, §14.5): each image's (t, h, w) as host ints,
and what the tower derives from them once per grid tuple, on the device: the attention boundaries
(`cu_seqlens`, host and device), the longest sequence and the 2-D RoPE tables.

A tower forward reads the layout, not `grid_thws`, so given the grids as host ints (a tuple, or a
CPU tensor) and a layout built before, it reads nothing back from the device and copies nothing to
it: the form a captured training step needs (k3/train/vl_trainer.py). A [N, 3] tensor on a device
is read back once, as before.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.model.vision.rope2d import rope_angles

Grids = tuple[tuple[int, int, int], ...]
MAX_LAYOUTS = 64  # grid tuples kept per tower: a training run has a handful, a server a few image sizes


def host_grids(grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> Grids:
    """grid_thws [N, 3] (a tensor, or a sequence of (t, h, w)) as Python ints."""
    if isinstance(grid_thws, torch.Tensor):
        if grid_thws.dim() != 2 or grid_thws.shape[1] != 3:
            raise ValueError(f"grid_thws must be [N, 3] (t, h, w), got {tuple(grid_thws.shape)}")
        grid_thws = grid_thws.tolist()
    grids = tuple(tuple(int(v) for v in g) for g in grid_thws)
    if any(len(g) != 3 for g in grids):
        raise ValueError(f"grid_thws must be [N, 3] (t, h, w), got {grids}")
    return grids


@dataclass(frozen=True)
class ImageLayout:
    grids: Grids
    bounds: tuple[int, ...]  # cu_seqlens on the host: each image's t * h * w patches attend together
    cu_seqlens: torch.Tensor  # int32 [N + 1] on the device
    max_seqlen: int
    rope: tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [L, K/2] fp32 on the device

    @property
    def patches(self) -> int:
        return self.bounds[-1]


@torch.inference_mode(False)  # built under a server's inference mode, still usable by a training forward
def build_layout(grids: Grids, head_dim: int, device: torch.device | None) -> ImageLayout:
    lengths = [t * h * w for t, h, w in grids]
    bounds = (0, *itertools.accumulate(lengths))
    return ImageLayout(grids, bounds, torch.tensor(bounds, dtype=torch.int32, device=device),
                       max(lengths, default=0), rope_angles(grids, head_dim, device=device))


class LayoutCache:
    """ImageLayouts by (grids, device), the oldest dropped past MAX_LAYOUTS. A captured graph reads
    its layout's tensors: a run's few grid tuples stay cached (and so alive) while it replays."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self._layouts: dict[tuple, ImageLayout] = {}

    def get(self, grid_thws: torch.Tensor | Sequence[Sequence[int]], device: torch.device) -> ImageLayout:
        grids = host_grids(grid_thws)
        key = (grids, torch.device(device))
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                del self._layouts[next(iter(self._layouts))]
            layout = self._layouts[key] = build_layout(grids, self.head_dim, device)
        return layout
