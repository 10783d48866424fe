"""The published K3 vision_config builds (on the meta device) exactly the checkpoint's vision
tensors: names and shapes of moonshotai/Kimi-K3's `vision_tower.*` / `mm_projector.*`, as the
official `modeling_kimi_k3.py` declares them (27 blocks of norm0, wqkv, wo, norm1, mlp.fc0,
mlp.fc1; a Conv2d patch projection and a 64 x 64 spatial table; PatchMergerMLPV2's proj.0,
proj.2 and post_norm), with no persistent buffers (the temporal table and RoPE are computed)."""
from __future__ import annotations

import json

import torch

from k3.model.vision import VisionConfig, VisionModel
from tests.helpers import K3_CONFIG_JSON


def expected() -> dict[str, tuple[int, ...]]:
    D, Q, F, C = 1024, 1536, 4096, 7168
    names = {"vision_tower.patch_embed.proj.weight": (D, 3, 14, 14),
             "vision_tower.patch_embed.pos_emb.weight": (64, 64, D)}
    for i in range(27):
        b = f"vision_tower.encoder.blocks.{i}."
        names |= {b + "norm0.weight": (D,), b + "norm1.weight": (D,), b + "wqkv.weight": (3 * Q, D),
                  b + "wo.weight": (D, Q), b + "mlp.fc0.weight": (F, D), b + "mlp.fc1.weight": (D, F)}
    names |= {"vision_tower.encoder.final_layernorm.weight": (D,),
              "mm_projector.proj.0.weight": (4 * D, 4 * D), "mm_projector.proj.2.weight": (C, 4 * D),
              "mm_projector.post_norm.weight": (C,)}
    return names


def test_published_config_builds_the_official_tensors():
    cfg = VisionConfig.from_dict(json.loads(K3_CONFIG_JSON.read_text())["vision_config"])
    with torch.device("meta"):
        model = VisionModel(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected()
    assert sum(v.numel() for v in model.parameters()) == 447_358_976
