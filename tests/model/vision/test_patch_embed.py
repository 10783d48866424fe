"""Patch embedding and the divided-fixed position embedding (DESIGN §7) against transformers'
Kimi-K2.5 `Kimi_K25VisionPositionEmbeddings` (same table, resampled by a gather it derives from
`F.interpolate`; switched to K3's bilinear mode) and the official F.interpolate formula in fp64."""
from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionPositionEmbeddings

from k3.model.vision.patch_embed import DividedFixedPosEmb, PatchEmbed
from tests.helpers import assert_rel_close
from tests.model.vision.helpers import GRIDS, pixels, ref_pos, tiny_config

D, SIDE, T = 32, 8, 4


def _pos() -> DividedFixedPosEmb:
    torch.manual_seed(0)
    return DividedFixedPosEmb(SIDE, SIDE, T, D, "bilinear")


@pytest.mark.parametrize("grids", [GRIDS, [(1, 8, 8)], [(4, 3, 5)], [(1, 64, 2)]],
                         ids=["mixed", "table-size", "video-t4", "tall"])
def test_pos_emb_matches_transformers(grids):
    ours = _pos()
    theirs = Kimi_K25VisionPositionEmbeddings(Kimi_K25VisionConfig(
        hidden_size=D, num_attention_heads=2, pos_emb_height=SIDE, pos_emb_width=SIDE, pos_emb_time=T))
    theirs.interpolation_mode = "bilinear"  # K3's pos_emb_interpolation_mode (K2.5 ships bicubic)
    with torch.no_grad():
        theirs.position_embeddings.copy_(ours.weight)
    g = torch.tensor(grids)
    x = torch.randn(int(g.prod(-1).sum()), D)
    assert_rel_close("pos_emb", theirs(x, g), ours(x, g), 1e-6)


def test_pos_emb_matches_official_formula_fp64():
    ours = _pos().double()
    g = torch.tensor(GRIDS)
    x = torch.zeros(int(g.prod(-1).sum()), D, dtype=torch.float64)
    assert_rel_close("pos_emb", ref_pos(ours.weight, GRIDS, T), ours(x, g), 1e-7)


def test_images_get_no_temporal_term_and_frames_differ():
    pos, g = _pos(), torch.tensor([(1, 2, 2), (2, 2, 2)])
    out = pos(torch.zeros(12, D), g)
    table = pos.spatial(2, 2)
    assert torch.equal(out[:4], table)  # t == 1: the spatial table alone
    assert torch.allclose(out[4:8] - table, pos.time_weight[0].expand(4, D))  # frame 0: sin 0 | cos 0
    assert torch.allclose(out[8:] - table, pos.time_weight[1].expand(4, D), atol=1e-6)


def test_too_many_frames_is_an_error():
    with pytest.raises(ValueError, match="5 frames"):
        _pos()(torch.zeros(5 * 4, D), torch.tensor([(5, 2, 2)]))


def test_patch_projection_is_a_linear_map_of_the_flat_patch():
    cfg = tiny_config()
    embed = PatchEmbed(cfg).double()
    px, g = pixels(GRIDS, cfg.patch_size)
    px = px.double()
    ref = px.flatten(1) @ embed.proj.weight.flatten(1).T + ref_pos(embed.pos_emb.weight, GRIDS, cfg.init_pos_emb_time)
    assert_rel_close("patch_embed", ref, embed(px, g), 1e-7)  # fp32 sin/cos table
    assert embed.proj.bias is None
