"""The K3 vision encoder: MoonViT-V2 tower plus the patchmergerv2 projector (DESIGN §7).

Pixels of N packed images/videos to one text-width embedding per merged 2 x 2 window, ready to
replace the image placeholder tokens. State-dict names are the published checkpoint's
(`vision_tower.*`, `mm_projector.*`), so loading is the checkpoint's tensors as they are.
L packed patches, P patch size, M merged tokens, C text width (text_hidden_size).
"""
from __future__ import annotations

import torch
from torch import nn

from k3.model.vision.config import VisionConfig
from k3.model.vision.merge import merged_counts
from k3.model.vision.projector import PatchMergerMLPV2
from k3.model.vision.tower import MoonViT


class VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.vision_tower = MoonViT(cfg)
        self.mm_projector = PatchMergerMLPV2(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """pixel_values [L, 3, P, P], grid_thws [N, 3] -> [M, C], images in order; split per image
        with `merged_counts(grid_thws, config.merge_kernel_size)`."""
        # the official model casts pixels to the tower's dtype before the patch convolution
        pixel_values = pixel_values.to(self.vision_tower.patch_embed.proj.weight.dtype)
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def merged_counts(self, grid_thws: torch.Tensor) -> list[int]:
        return merged_counts(grid_thws, self.config.merge_kernel_size)
