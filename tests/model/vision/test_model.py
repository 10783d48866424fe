"""The whole encoder, pixels to text-width embeddings (DESIGN §7), against an fp64 reference of the
official formulas (tests/model/vision/helpers.py), outputs and every gradient; packing; errors."""
from __future__ import annotations

import pytest
import torch

from k3.model.vision import VisionModel
from k3.model.vision.tower import image_attention, image_cu_seqlens
from tests.helpers import assert_rel_close
from tests.model.vision.helpers import GRIDS, pixels, ref_forward, tiny_model


def test_forward_and_gradients_match_the_official_formulas_fp64():
    model = tiny_model()
    cfg = model.config
    px, g = pixels(GRIDS, cfg.patch_size)
    out = model(px, g)
    assert out.shape == (sum(model.merged_counts(g)), cfg.text_hidden_size)
    params = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    ref = ref_forward(params, cfg, px.double(), GRIDS)
    assert_rel_close("output", ref, out, 1e-5)

    probe = torch.randn_like(ref)
    (out * probe.float()).sum().backward()
    (ref * probe).sum().backward()
    for name, p in model.named_parameters():
        assert_rel_close(f"grad {name}", params[name].grad, p.grad, 1e-4)


@pytest.mark.parametrize("grids", [GRIDS, [(1, 2, 2), (1, 6, 4), (2, 4, 4), (1, 2, 2)]], ids=["mixed", "repeats"])
def test_packed_images_equal_each_image_alone(grids):
    model = tiny_model()
    px, g = pixels(grids, model.config.patch_size)
    with torch.no_grad():
        packed = model(px, g).split(model.merged_counts(g))
        start = 0
        for i, (t, h, w) in enumerate(grids):
            alone = model(px[start:start + t * h * w], g[i:i + 1])
            assert_rel_close(f"image {i} {t}x{h}x{w}", alone, packed[i], 1e-6)
            start += t * h * w


def test_images_never_attend_to_each_other():
    torch.manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8) for _ in range(3))
    cu = image_cu_seqlens(torch.tensor([(1, 2, 2), (1, 2, 3)]))
    out = image_attention(q, k, v, cu, 6)
    v2 = v.clone()
    v2[4:] += 100.0  # change only the second image's values
    assert torch.equal(image_attention(q, k, v2, cu, 6)[:4], out[:4])


def test_tower_without_qkv_size_and_with_layernorm_and_biases():
    # the official absent-key meanings (K2.5-style tower): head dim = width / heads, LayerNorm, biases
    model = tiny_model(qkv_hidden_size=None, norm_type="layernorm", attn_bias=True, linear_bias=True,
                       patch_embed_proj_bias=True)
    block = model.vision_tower.encoder.blocks[0]
    assert block.wqkv.weight.shape == (3 * 32, 32) and block.wqkv.bias is not None
    assert isinstance(block.norm0, torch.nn.LayerNorm)
    px, g = pixels(GRIDS[:2], model.config.patch_size)
    assert torch.isfinite(model(px, g)).all()


def test_bf16_runs_and_stays_near_fp32():
    model = tiny_model()
    px, g = pixels(GRIDS, model.config.patch_size)
    with torch.no_grad():
        ref = model(px, g)
        out = model.to(torch.bfloat16)(px, g)  # pixels are cast to the tower's dtype
    assert out.dtype == torch.bfloat16
    assert_rel_close("bf16", ref, out, 3e-2)


def test_pixel_count_must_match_the_grid():
    model = VisionModel(tiny_model().config)
    px, g = pixels([(1, 2, 2)], model.config.patch_size)
    with pytest.raises(ValueError, match="5 patches given"):
        model(torch.cat([px, px[:1]]), g)
