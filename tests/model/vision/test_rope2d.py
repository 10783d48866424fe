"""2-D RoPE (DESIGN §7) against transformers' Kimi-K2.5 axial rotary embedding, after mapping the
official interleaved pair layout (x[2c], x[2c+1]) to transformers' half layout (x[c], x[c+K/2]),
and against the official complex-multiply formula in fp64."""
from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
from transformers.models.kimi_k25.modeling_kimi_k25 import (
    Kimi_K25VisionRotaryEmbedding,
    apply_rotary_pos_emb_vision,
)
from transformers.vision_utils import get_vision_position_ids

from k3.model.vision.rope2d import apply_rope_2d, rope_angles
from tests.helpers import assert_rel_close
from tests.model.vision.helpers import GRIDS, ref_freqs_cis, ref_rope

H, K = 2, 24


def test_rope_matches_transformers_in_its_layout():
    g = torch.tensor(GRIDS)
    L = int(g.prod(-1).sum())
    q, k = torch.randn(L, H, K), torch.randn(L, H, K)
    cos, sin = rope_angles(g, K)
    ours_q, ours_k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)

    rotary = Kimi_K25VisionRotaryEmbedding(Kimi_K25VisionConfig(
        hidden_size=H * K, num_attention_heads=H, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}))
    tcos, tsin = rotary(q, get_vision_position_ids(g, spatial_merge_size=1))
    half = torch.cat([torch.arange(0, K, 2), torch.arange(1, K, 2)])  # interleaved -> half layout
    tq, tk = apply_rotary_pos_emb_vision(q[..., half][None], k[..., half][None], tcos[None], tsin[None])
    back = torch.argsort(half)
    assert_rel_close("q", tq[0][..., back], ours_q, 1e-6)
    assert_rel_close("k", tk[0][..., back], ours_k, 1e-6)


def test_rope_matches_official_formula_fp64():
    g = torch.tensor(GRIDS)
    q = torch.randn(int(g.prod(-1).sum()), H, K, dtype=torch.float64)
    cos, sin = rope_angles(g, K)
    assert_rel_close("rope", ref_rope(q, ref_freqs_cis(GRIDS, K)), apply_rope_2d(q, cos, sin), 1e-6)


def test_video_frames_share_the_spatial_angles_and_dtype_is_kept():
    cos, sin = rope_angles(torch.tensor([(3, 2, 5)]), K)
    assert torch.equal(cos[:10], cos[10:20]) and torch.equal(sin[:10], sin[20:])
    x = torch.randn(30, H, K, dtype=torch.bfloat16)
    assert apply_rope_2d(x, cos, sin).dtype == torch.bfloat16


def test_grid_beyond_the_official_table_is_an_error():
    with pytest.raises(ValueError, match="513 x 1"):
        rope_angles(torch.tensor([(1, 513, 1)]), K)
