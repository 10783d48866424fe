"""`mla_use_nope: false` (the RoPE ablation, k3/model/mla.py): q_pe and k_pe rotated by each
token's position in its document, with k_pe cached rotated, so prefill = token-by-token decode,
packed = separate, a serving step's packed row = each document continued alone, and the scores'
pe part depends on relative position only. It is not K3's (NoPE): this checks the ablation."""
from __future__ import annotations

import pytest
import torch

from k3.model.cache import K3Cache, MLAState
from k3.model.mla import GatedMLA
from k3.model.transformer import K3ForCausalLM
from tests.helpers import assert_rel_close
from tests.helpers.models import randomized, small_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomized(K3ForCausalLM(small_config(mla_use_nope=False)))


@pytest.mark.parametrize("mla_impl", ["naive", "absorb"])
def test_decode_equals_one_pass(model, mla_impl):
    model.config.mla_impl = mla_impl
    ids = torch.randint(0, 256, (2, 29))
    full = model(ids)
    cache = K3Cache.empty(model.config, 2)
    assert_rel_close("prefill part", full[:, :12], model(ids[:, :12], cache=cache), 1e-5)
    for t in range(12, 29):
        step = model(ids[:, t:t + 1], cache=cache)
    assert_rel_close("last-position logits", full[:, -1], step[:, -1], 1e-5)
    model.config.mla_impl = "auto"


def test_packed_equals_separate(model):
    lens = [5, 23, 1, 17]
    seqs = [torch.randint(0, 256, (n,)) for n in lens]
    cu = torch.tensor([0] + lens).cumsum(0)
    packed = model(torch.cat(seqs)[None], cu_seqlens=cu)[0]
    for i, s in enumerate(seqs):
        assert_rel_close(f"doc {i}", model(s[None])[0], packed[cu[i]:cu[i + 1]], 1e-5)


def layer_and_inputs(use_nope: bool):
    cfg = small_config(mla_use_nope=use_nope)
    torch.manual_seed(3)
    layer = GatedMLA(cfg, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    return cfg, layer


def test_a_serving_step_row_equals_each_document_alone():
    cfg, layer = layer_and_inputs(False)
    past, new = [4, 0, 9, 6], [1, 5, 1, 3]
    xs = [torch.randn(1, n, cfg.hidden_size) for n in past]
    steps = [torch.randn(1, n, cfg.hidden_size) for n in new]
    alone = []
    for x, step in zip(xs, steps):
        state = MLAState.empty(cfg, 1, capacity=16)
        if x.shape[1]:
            layer(x, state=state)
        alone.append(layer(step, state=state)[0])
    state = MLAState.empty(cfg, len(past), capacity=16)
    layer(torch.cat(xs, dim=1), cu_seqlens=torch.tensor([0, *past]).cumsum(0), state=state)
    out = layer(torch.cat(steps, dim=1), cu_seqlens=torch.tensor([0, *new]).cumsum(0), state=state)[0]
    starts = torch.tensor([0, *new]).cumsum(0).tolist()
    for n, o in enumerate(alone):
        assert_rel_close(f"doc {n}", o, out[starts[n]:starts[n + 1]], 1e-5)


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
