"""`mla_use_nope: false` (the RoPE ablation, k3/model/mla.py): q_pe and k_pe rotated by each
token's position in its document, with k_pe cached rotated; the scores' pe part depends on
relative position only. It is not K3's (NoPE): this checks the ablation. Prefill = decode, packed
= separate and a serving step's row = each document alone run for both in tests/model/test_model.py."""
from __future__ import annotations

import torch

from k3.model.mla import GatedMLA
from tests.helpers import assert_rel_close
from tests.helpers.models import small_config


def layer_and_inputs(use_nope: bool):
    cfg = small_config(mla_use_nope=use_nope)
    torch.manual_seed(3)
    layer = GatedMLA(cfg, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    return cfg, layer


def test_rope_is_on_and_relative():
    """The same weights give other outputs than NoPE; q_pe . k_pe after rotation depends only on
    the distance between the two positions."""
    cfg, layer = layer_and_inputs(False)
    x = torch.randn(1, 7, cfg.hidden_size)
    rope_out = layer(x)
    cfg.mla_use_nope = True
    assert (layer(x) - rope_out).abs().max() > 1e-3
    cfg.mla_use_nope = False
    q = torch.randn(1, 1, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    lat = torch.randn(1, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    R = cfg.qk_rope_head_dim

    def score(i, j):
        qi, _ = layer.rotate(q, lat, torch.tensor([[i]]))
        _, kj = layer.rotate(q, lat, torch.tensor([[j]]))
        return (qi[0, 0, :, -R:] * kj[0, 0, -R:]).sum(-1)

    assert_rel_close("distance 3", score(5, 2), score(13, 10), 1e-5)
    assert (score(5, 2) - score(5, 4)).abs().max() > 1e-3
