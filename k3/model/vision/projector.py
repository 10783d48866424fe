"""`patchmergerv2`, the K3 mm projector (DESIGN §7): merged patches to text-width embeddings.

M merged tokens, G = kh * kw patches per token, D tower width (mm_hidden_size), C text width.
As the official `PatchMergerMLPV2` (moonshotai/Kimi-K3 `modeling_kimi_k3.py`): the G patch vectors
are concatenated (no pre-norm, unlike K2.5's `patchmerger`), then Linear(GD, GD) -> exact erf GELU
-> Linear(GD, C), both without bias, then an RMSNorm AFTER the projection (eps projector_ln_eps).
Official names under `mm_projector.`: proj.0, proj.2 (proj.1 is the GELU), post_norm.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from k3.model.vision.config import VisionConfig


class PatchMergerMLPV2(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.in_features = cfg.mm_hidden_size * cfg.merge_size
        self.proj = nn.Sequential(
            nn.Linear(self.in_features, self.in_features, bias=False),
            nn.GELU(),
            nn.Linear(self.in_features, cfg.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_ln_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in (self.proj[0], self.proj[2]):  # the official init: truncated normal, std sqrt(2 / fan_in)
            nn.init.trunc_normal_(m.weight, std=math.sqrt(2 / m.in_features))
        self.post_norm.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, G, D] (or [M, G * D]) -> [M, C]."""
        return self.post_norm(self.proj(x.reshape(x.shape[0], self.in_features)))
