"""VisionConfig reads and writes the published `vision_config` losslessly (DESIGN §7)."""
from __future__ import annotations

import json

import pytest

from k3.config import ConfigError
from k3.model.vision import VisionConfig
from tests.helpers import K3_CONFIG_JSON


def published() -> dict:
    return json.loads(K3_CONFIG_JSON.read_text())["vision_config"]


def test_published_round_trip_is_lossless():
    d = published()
    cfg = VisionConfig.from_dict(d)
    assert json.dumps(cfg.to_dict()) == json.dumps(d)  # same keys, values and order
    assert cfg.extra == {"_attn_implementation": "flash_attention_2"}


def test_published_values_and_derived_sizes():
    cfg = VisionConfig.from_dict(published())
    assert cfg == VisionConfig()  # the defaults are K3's tower
    assert (cfg.vt_num_hidden_layers, cfg.vt_hidden_size, cfg.vt_num_attention_heads) == (27, 1024, 12)
    assert (cfg.qkv_size, cfg.head_dim, cfg.vt_intermediate_size, cfg.patch_size) == (1536, 128, 4096, 14)
    assert (cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.init_pos_emb_time) == (64, 64, 4)
    assert (cfg.norm_type, cfg.pos_emb_type, cfg.pos_emb_interpolation_mode) == ("rmsnorm", "divided_fixed", "bilinear")
    assert (cfg.merge_type, cfg.merge_kernel_size, cfg.merge_size) == ("sd2_tpool", [2, 2], 4)
    assert (cfg.mm_projector_type, cfg.text_hidden_size, cfg.projector_ln_eps) == ("patchmergerv2", 7168, 1e-5)
    assert not (cfg.attn_bias or cfg.linear_bias or cfg.patch_embed_proj_bias)


def test_absent_keys_mean_the_official_defaults_and_stay_absent():
    d = {k: v for k, v in published().items()
         if k not in ("qkv_hidden_size", "norm_type", "attn_bias", "linear_bias", "patch_embed_proj_bias")}
    d["vt_num_attention_heads"] = 16  # K2.5's tower: heads split the width itself
    cfg = VisionConfig.from_dict(d)
    assert cfg.qkv_hidden_size is None and (cfg.qkv_size, cfg.head_dim) == (1024, 64)
    assert (cfg.norm_type, cfg.attn_bias, cfg.linear_bias, cfg.patch_embed_proj_bias) == ("layernorm", True, True, True)
    assert cfg.to_dict() == d
    written = cfg.replace(norm_type="rmsnorm").to_dict()
    assert written["norm_type"] == "rmsnorm" and list(written)[:-1] == list(d)


@pytest.mark.parametrize("key, value, field", [
    ("merge_type", "sd2", "merge_type"),
    ("mm_projector_type", "patchmerger", "mm_projector_type"),
    ("mm_hidden_size", 1152, "mm_hidden_size"),
    ("qkv_hidden_size", 1000, "qkv_hidden_size"),
    ("merge_kernel_size", [2], "merge_kernel_size"),
])
def test_unsupported_values_name_their_field(key, value, field):
    with pytest.raises(ConfigError, match=f"VisionConfig.{field}"):
        VisionConfig.from_dict({**published(), key: value})


def test_a_missing_required_key_is_named():
    d = published()
    del d["vt_hidden_size"]
    with pytest.raises(ConfigError, match="vt_hidden_size"):
        VisionConfig.from_dict(d)
