"""Tiny vision configs, random packed inputs, and an fp64 reference of the official formulas
(moonshotai/Kimi-K3 `modeling_kimi_k3.py`: MoonViT3dPretrainedModel, tpool_patch_merger,
PatchMergerMLPV2), written from the formulas, independent of k3's modules."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from k3.model.vision import VisionConfig, VisionModel

# width 32, 2 heads of 24 (qkv 48 != width, as K3's 1536 != 1024), an 8 x 8 x 4 position table
TINY = {"vt_hidden_size": 32, "mm_hidden_size": 32, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
        "qkv_hidden_size": 48, "vt_intermediate_size": 64, "text_hidden_size": 40, "init_pos_emb_height": 8,
        "init_pos_emb_width": 8, "init_pos_emb_time": 4, "patch_size": 4}
# images (t = 1) of odd sizes, smaller and larger than the table, and a 3-frame video
GRIDS = [(1, 4, 6), (3, 2, 4), (1, 10, 12), (1, 8, 8)]


def tiny_config(**changes) -> VisionConfig:
    return VisionConfig(**{**TINY, **changes})


def tiny_model(seed: int = 0, **changes) -> VisionModel:
    torch.manual_seed(seed)
    model = VisionModel(tiny_config(**changes))
    with torch.no_grad():  # norms away from one so a wrong norm placement shows
        for name, p in model.named_parameters():
            if name.endswith(("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith("pos_emb.weight"):
                p.mul_(0.5)
    return model


def pixels(grids, patch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.tensor(grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(g.prod(-1).sum()), 3, patch, patch, generator=gen), g


# ------------------------------------------------------------------ fp64 reference, official formulas
def ref_sincos(t: int, dim: int) -> torch.Tensor:
    """get_1d_sincos_pos_embed: float32 numpy, as the official buffer is built."""
    omega = np.arange(dim // 2, dtype=np.float32) / (dim / 2.0)
    omega = 1.0 / 10000 ** omega
    out = np.einsum("m,d->md", np.arange(t, dtype=np.float32), omega)
    return torch.from_numpy(np.concatenate([np.sin(out), np.cos(out)], axis=1)).double()


def ref_pos(table: torch.Tensor, grids, num_frames: int, mode: str = "bilinear") -> torch.Tensor:
    parts = []
    for t, h, w in grids:
        if (h, w) == tuple(table.shape[:2]):
            sp = table.flatten(0, 1)
        else:
            sp = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode=mode)[0].permute(1, 2, 0).flatten(0, 1)
        parts.append(sp if t == 1 else (sp[None] + ref_sincos(num_frames, table.shape[-1])[:t, None]).flatten(0, 1))
    return torch.cat(parts)


def ref_freqs_cis(grids, head_dim: int) -> torch.Tensor:
    """[L, K/2] complex128: pair 2i turns by col * f_i, pair 2i + 1 by row * f_i (Rope2DPosEmbRepeated)."""
    f = 1.0 / (10000 ** (torch.arange(0, head_dim, 4, dtype=torch.float64) / head_dim))
    out = []
    for t, h, w in grids:
        y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64),
                              indexing="ij")
        ang = torch.stack([x.flatten()[:, None] * f, y.flatten()[:, None] * f], dim=-1).flatten(1)
        out.append(torch.polar(torch.ones_like(ang), ang).repeat(t, 1))
    return torch.cat(out)


def ref_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * cis[:, None, :]).flatten(-2)


def ref_rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_forward(p: dict[str, torch.Tensor], cfg: VisionConfig, px: torch.Tensor, grids) -> torch.Tensor:
    """The official forward in fp64 from a parameter dict; attention over the packed sequence with a
    block-diagonal mask, as the official eager path."""
    eps = torch.finfo(torch.float32).eps  # nn.RMSNorm(eps=None) on the fp32 model k3 is compared with
    D, H, K = cfg.vt_hidden_size, cfg.vt_num_attention_heads, cfg.head_dim
    vt = "vision_tower."
    x = px.flatten(1) @ p[vt + "patch_embed.proj.weight"].flatten(1).T
    x = x + ref_pos(p[vt + "patch_embed.pos_emb.weight"], grids, cfg.init_pos_emb_time)
    lens = [t * h * w for t, h, w in grids]
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    same = seg[:, None] == seg[None, :]
    cis = ref_freqs_cis(grids, K)
    for i in range(cfg.vt_num_hidden_layers):
        b = f"{vt}encoder.blocks.{i}."
        h_ = ref_rms(x, p[b + "norm0.weight"], eps)
        q, k, v = (h_ @ p[b + "wqkv.weight"].T).view(-1, 3, H, K).unbind(1)
        q, k = ref_rope(q, cis), ref_rope(k, cis)
        s = torch.einsum("qhk,shk->hqs", q, k) / math.sqrt(K)
        a = torch.softmax(s.masked_fill(~same, float("-inf")), dim=-1)
        x = x + torch.einsum("hqs,shk->qhk", a, v).flatten(1) @ p[b + "wo.weight"].T
        h_ = ref_rms(x, p[b + "norm1.weight"], eps)
        x = x + F.gelu(h_ @ p[b + "mlp.fc0.weight"].T, approximate="tanh") @ p[b + "mlp.fc1.weight"].T
    x = ref_rms(x, p[vt + "encoder.final_layernorm.weight"], eps)
    kh, kw = cfg.merge_kernel_size
    merged, start = [], 0
    for t, h, w in grids:
        s = x[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, D)
        merged.append(s.permute(0, 1, 3, 2, 4, 5).mean(0).reshape(-1, kh * kw * D))
        start += t * h * w
    m = torch.cat(merged)
    y = F.gelu(m @ p["mm_projector.proj.0.weight"].T) @ p["mm_projector.proj.2.weight"].T
    return ref_rms(y, p["mm_projector.post_norm.weight"], cfg.projector_ln_eps)
