"""Per-Head Muon (DESIGN §8): parameter routing, per-block orthogonalization, the update rule, and the
optimizer state's round trip through a training checkpoint."""
from __future__ import annotations

import math

import pytest
import torch

from k3.checkpoint import training_state as ckpt
from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.train.muon import Blocks, PerHeadMuon, head_blocks, newton_schulz, orthogonalize, param_groups
from k3.train.schedule import warmup_cosine
from tests.helpers import assert_rel_close

# Singular values the 5-step quintic leaves for full-rank inputs (KellerJordan: "roughly [0.7, 1.2]")
NS_BAND = (0.65, 1.25)
HEAD_SCALES = [1e3, 1.0, 1e-3, 1e-6]


def svals(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())


@pytest.mark.parametrize("axis", [0, 1], ids=["row-blocks", "col-blocks"])
def test_each_head_block_is_orthogonalized_separately(axis):
    d, D = 32, 96
    blocks = [torch.randn(d, D) * s for s in HEAD_SCALES] if axis == 0 else [torch.randn(D, d) * s for s in HEAD_SCALES]
    g = torch.cat(blocks, dim=axis)  # [H*d, D] (q/k/v-like) or [D, H*d] (o_proj-like)
    out = orthogonalize(g, Blocks(axis, d))
    scale = 0.2 * math.sqrt(max(d, D))
    for h, block in enumerate(out.split(d, dim=axis)):
        s = svals(block / scale)
        assert NS_BAND[0] <= s.min() and s.max() <= NS_BAND[1], f"head {h}: singular values {s.min():.3f}..{s.max():.3f}"
        assert_rel_close(f"head {h}", newton_schulz(blocks[h][None])[0] * scale, block, 1e-5)
    # control: orthogonalizing the whole matrix leaves the small heads' updates near zero
    whole = orthogonalize(g, Blocks())
    assert svals(whole.split(d, dim=axis)[-1]).max() < 1e-3


def test_stacked_weights_equal_one_by_one():
    g = torch.randn(5, 64, 48)
    out = orthogonalize(g, Blocks(1, 16))
    for i in range(5):
        assert_rel_close(f"weight {i}", orthogonalize(g[i], Blocks(1, 16)), out[i], 1e-5)


def test_parameter_routing_k3_tiny():
    cfg = load_config("k3-tiny")
    model = K3ForCausalLM(cfg)
    named = dict(model.named_parameters())
    route = {n: head_blocks(cfg, n, p) for n, p in named.items()}
    # KDA layer 0, MLA layer 3 (1-indexed 4)
    assert route["model.layers.0.self_attn.q_proj.weight"] == Blocks(0, cfg.kda_head_dim)
    assert route["model.layers.0.self_attn.g_proj.weight"] == Blocks(0, cfg.kda_head_dim)
    assert route["model.layers.0.self_attn.o_proj.weight"] == Blocks(1, cfg.kda_head_dim)
    assert route["model.layers.3.self_attn.q_b_proj.weight"] == Blocks(0, cfg.qk_head_dim)
    assert route["model.layers.3.self_attn.kv_b_proj.weight"] == Blocks(0, cfg.qk_nope_head_dim + cfg.v_head_dim)
    assert route["model.layers.3.self_attn.g_proj.weight"] == Blocks(0, cfg.v_head_dim)
    assert route["model.layers.3.self_attn.o_proj.weight"] == Blocks(1, cfg.v_head_dim)
    assert route["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == Blocks()
    assert route["model.layers.1.block_sparse_moe.experts.w1"] == Blocks()  # stacked [E, I, H]: per expert
    assert route["model.layers.1.block_sparse_moe.gate.weight"] == Blocks()
    for adamw in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.A_log",
                  "model.layers.0.self_attn.dt_bias", "model.layers.0.self_attn.q_conv1d.weight",
                  "model.layers.1.mlp_res_proj.weight", "model.output_attn_res_proj.weight", "model.norm.weight"):
        assert route[adamw] is None, adamw
    groups = param_groups(model, cfg, weight_decay=0.1)
    grouped = [n for g in groups for n in g["param_names"]]
    assert sorted(grouped) == sorted(named)  # every trainable parameter exactly once
    assert not any("e_score_correction_bias" in n for n in grouped)  # moved by balancing only
    no_decay = next(g for g in groups if g["name"] == "adamw_no_decay")
    assert no_decay["weight_decay"] == 0.0 and "model.output_attn_res_proj.weight" in no_decay["param_names"]


def test_muon_update_rule():
    """p <- p(1 - lr wd) - lr * 0.2 sqrt(max block) * NS(nesterov momentum), per head block."""
    w = torch.nn.Parameter(torch.randn(64, 48))
    opt = PerHeadMuon([{"name": "m", "kind": "muon", "params": [w], "block_axis": 0, "block_size": 16}],
                      lr=0.02, weight_decay=0.1, momentum=0.9)
    w0 = w.detach().clone()
    grad = torch.randn(64, 48)
    w.grad = grad.clone()
    opt.step()
    buf = 0.1 * grad  # lerp(0, g, 1 - m)
    nesterov = grad.lerp(buf, 0.9)
    expected = w0 * (1 - 0.02 * 0.1) - 0.02 * orthogonalize(nesterov, Blocks(0, 16))
    assert_rel_close("muon step", expected, w.detach(), 1e-6)
    assert_rel_close("momentum", buf, opt.state[w]["momentum_buffer"], 1e-6)


def _tiny_setup(seed: int):
    cfg = load_config("k3-tiny").replace(vocab_size=128, hidden_size=64, num_hidden_layers=4, kda_layers=[],
                                         full_attn_layers=[], kda_chunk_size=16, intermediate_size=96)
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg)
    opt = PerHeadMuon(param_groups(model, cfg, weight_decay=0.1), lr=3e-3)
    return model, opt, warmup_cosine(opt, 20)


def _step(model, opt, sched, ids):
    opt.zero_grad()
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:])
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def test_optimizer_state_round_trips_through_checkpoint(tmp_path):
    ids = torch.randint(0, 128, (1, 33))
    model, opt, sched = _tiny_setup(0)
    _step(model, opt, sched, ids)
    folder = ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, {}, lambda d: None, keep=1)
    model2, opt2, sched2 = _tiny_setup(1)  # different init: everything must come from the files
    ckpt.load_checkpoint(folder, model2, opt2, sched2)
    names = {id(p): n for n, p in model.named_parameters()}
    names2 = {n: p for n, p in model2.named_parameters()}
    for p, state in opt.state.items():
        restored = opt2.state[names2[names[id(p)]]]
        assert state.keys() == restored.keys()
        for key, value in state.items():
            assert torch.equal(value, restored[key]), f"{names[id(p)]}.{key}"
    assert [g["name"] for g in opt2.param_groups] == [g["name"] for g in opt.param_groups]
    assert sched2.get_last_lr() == sched.get_last_lr()
    # and the continuation is bit-identical
    assert [_step(model, opt, sched, ids) for _ in range(2)] == [_step(model2, opt2, sched2, ids) for _ in range(2)]
    for (n, p), (_, p2) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, p2), n
