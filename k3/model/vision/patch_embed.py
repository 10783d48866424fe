"""Patch embedding and the divided-fixed absolute position embedding of MoonViT-V2 (DESIGN §7).

L packed patches of all images/videos, D width (vt_hidden_size), P patch size, grid_thws [N, 3]:
(frames t, patch rows h, patch columns w) per image or video, patches in (t, h, w) raster order.

"divided_fixed" (official `Learnable2DInterpPosEmbDivided_fixed`, moonshotai/Kimi-K3
`modeling_kimi_k3.py`): a learned spatial table [H0, W0, D] resized to each image's (h, w) with
`F.interpolate` (bilinear, align_corners=False), plus for videos (t > 1) a FIXED sin/cos table over
frames, a non-persistent buffer, so the checkpoint holds `pos_emb.weight` only. Single images
(t == 1) get no temporal term; frame f of a video gets row f (row 0 is sin 0 | cos 0 = [0.., 1..]).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.vision.config import VisionConfig


def sincos_table(positions: int, dim: int) -> torch.Tensor:
    """[positions, dim] = [sin(p * w_i) | cos(p * w_i)], w_i = 10000^(-i / (dim/2)), i < dim/2: the
    InternVideo2 1-D table the official code builds in float32 numpy."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0))
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class DividedFixedPosEmb(nn.Module):
    """x [L, D] + the learned spatial table resized per image + the fixed per-frame table."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, mode: str = "bilinear"):
        super().__init__()
        self.num_frames, self.mode = num_frames, mode
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.register_buffer("time_weight", sincos_table(num_frames, dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)  # the official init: N(0, 1)
        if self.time_weight.device.type != "meta":
            self.time_weight.copy_(sincos_table(*self.time_weight.shape))

    def spatial(self, h: int, w: int) -> torch.Tensor:
        """[h * w, D]: the table resized to an h x w grid (the table itself at its own size)."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        table = self.weight.permute(2, 0, 1).unsqueeze(0)  # [1, D, H0, W0]
        return F.interpolate(table, size=(h, w), mode=self.mode).squeeze(0).permute(1, 2, 0).flatten(0, 1)

    def forward(self, x: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        parts = []
        for t, h, w in (grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else grid_thws):
            if t > self.num_frames:  # the fixed table has init_pos_emb_time rows (official assert)
                raise ValueError(f"a video of {t} frames exceeds the {self.num_frames}-frame temporal table")
            pos = self.spatial(h, w)
            if t > 1:
                pos = (pos.unsqueeze(0) + self.time_weight[:t, None, :].to(pos.dtype)).flatten(0, 1)
            parts.append(pos)
        return x + torch.cat(parts)


class PatchEmbed(nn.Module):
    """pixels [L, 3, P, P] -> [L, D]: a P x P stride-P convolution per patch, then the position
    embedding. Official name `vision_tower.patch_embed` with children `proj` and `pos_emb`."""

    def __init__(self, cfg: VisionConfig, in_channels: int = 3):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(in_channels, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias)
        self.pos_emb = DividedFixedPosEmb(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.init_pos_emb_time,
                                          cfg.vt_hidden_size, cfg.pos_emb_interpolation_mode)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """grid_thws: a tensor, or (t, h, w) ints (then nothing is read back from the device)."""
        if isinstance(grid_thws, torch.Tensor):
            grid_thws = grid_thws.tolist()
        counts = sum(t * h * w for t, h, w in grid_thws)
        if pixel_values.shape[0] != counts:
            raise ValueError(f"{pixel_values.shape[0]} patches given, grid_thws describes {counts}")
        x = self.proj(pixel_values).flatten(1)
        return self.pos_emb(x, grid_thws)
