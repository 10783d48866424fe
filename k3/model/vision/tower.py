"""MoonViT-V2, the K3 vision tower (DESIGN §7): patch embedding, pre-norm encoder blocks with 2-D
RoPE over packed images, a final norm and the `sd2_tpool` merge. Official names (`vision_tower.`
prefix): patch_embed.{proj, pos_emb}, encoder.blocks.{i}.{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1},
encoder.final_layernorm, as moonshotai/Kimi-K3 `modeling_kimi_k3.py` (MoonViT3dPretrainedModel).

L packed patches, N images/videos, D width (vt_hidden_size), H heads, K head dim (qkv_hidden_size
/ H, not D / H: 1536 / 12 = 128 in K3), F MLP width. Each image or video attends only to itself
(bidirectional, all t * h * w patches jointly: one attention per block, not factorized).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.vision.config import VisionConfig
from k3.model.vision.layout import ImageLayout, LayoutCache
from k3.model.vision.merge import tpool_merge
from k3.model.vision.patch_embed import PatchEmbed
from k3.model.vision.rope2d import apply_rope_2d


def image_cu_seqlens(grid_thws: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """int32 [N + 1]: each image's or video's t * h * w patches are one attention sequence."""
    lengths = grid_thws.prod(-1).to(device=device, dtype=torch.int32)
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int, bounds: Sequence[int] | None = None) -> torch.Tensor:
    """Non-causal attention within each packed sequence: q, k, v [L, H, K] -> [L, H, K], scale K^-1/2.
    On CUDA (sm80+) in half precision one varlen flash kernel (the official tower's
    flash_attn_varlen_func); elsewhere `attention_per_sequence` (over `bounds`, cu_seqlens on the
    host, when given: no read back)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and torch.cuda.get_device_capability(q.device)[0] >= 8:
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn(q, k, v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return attention_per_sequence(q, k, v, cu_seqlens if bounds is None else bounds)


def attention_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """One SDPA call per sequence: never builds an L x L mask, whatever the number of images."""
    out = []
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    for s, e in itertools.pairwise(bounds):
        qi, ki, vi = (t[s:e].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1))
    return torch.cat(out)


def _norm(cfg: VisionConfig, dim: int) -> nn.Module:
    # eps unset as in the official MoonViTEncoderLayer: finfo(float32).eps for fp32 and bf16 inputs
    # since pytorch#142848; LayerNorm's default 1e-5.
    return nn.RMSNorm(dim) if cfg.norm_type == "rmsnorm" else nn.LayerNorm(dim)


class MLP2(nn.Module):
    """fc1(gelu_tanh(fc0(x))): D -> F -> D (official `MLP2`)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.vt_hidden_size, cfg.vt_intermediate_size, bias=cfg.linear_bias)
        self.fc1 = nn.Linear(cfg.vt_intermediate_size, cfg.vt_hidden_size, bias=cfg.linear_bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in (self.fc0, self.fc1):  # the official init: truncated normal, std sqrt(2 / fan_in)
            nn.init.trunc_normal_(m.weight, std=math.sqrt(2 / m.in_features))
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class MoonViTBlock(nn.Module):
    """x + wo(attn(rope(wqkv(norm0(x))))), then x + mlp(norm1(x)) (official `MoonViTEncoderLayer`)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = _norm(cfg, cfg.vt_hidden_size)
        self.norm1 = _norm(cfg, cfg.vt_hidden_size)
        self.mlp = MLP2(cfg)
        # wqkv rows are [q | k | v], each H x K (the official view (..., 3, H, K))
        self.wqkv = nn.Linear(cfg.vt_hidden_size, 3 * cfg.qkv_size, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.qkv_size, cfg.vt_hidden_size, bias=cfg.attn_bias)

    def attention(self, x: torch.Tensor, layout: ImageLayout) -> torch.Tensor:
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        q, k = apply_rope_2d(q, *layout.rope), apply_rope_2d(k, *layout.rope)
        return self.wo(image_attention(q, k, v, layout.cu_seqlens, layout.max_seqlen, layout.bounds).flatten(-2))

    def forward(self, x: torch.Tensor, layout: ImageLayout) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), layout)
        return x + self.mlp(self.norm1(x))


class MoonViTEncoder(nn.Module):
    """[L, D] -> [L, D]: the blocks over packed images, then the final norm."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.blocks = nn.ModuleList(MoonViTBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = _norm(cfg, cfg.vt_hidden_size)

    def forward(self, x: torch.Tensor, layout: ImageLayout) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, layout)
        return self.final_layernorm(x)


class MoonViT(nn.Module):
    """pixels [L, 3, P, P] + grid_thws [N, 3] -> merged [M, kh * kw, D] (official
    `MoonViT3dPretrainedModel`, the checkpoint's `vision_tower`). grid_thws: a tensor, or (t, h, w)
    ints; the grid-derived metadata is built once per grid tuple and device (k3/model/vision/layout.py),
    so with host grids a forward reads nothing back from the device (a captured step's form)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merge_kernel_size = tuple(cfg.merge_kernel_size)
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = MoonViTEncoder(cfg)
        self.layouts = LayoutCache(cfg.head_dim)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        layout = self.layouts.get(grid_thws, pixel_values.device)
        x = self.encoder(self.patch_embed(pixel_values, layout.grids), layout)
        return tpool_merge(x, layout.grids, self.merge_kernel_size)
