"""Stable LatentMoE and its router (DESIGN §6) against a dense per-token loop and transformers."""
import pytest
import torch

from k3.config import K3Config, load_config
from k3.model.moe import MoEGate, StableLatentMoE
from tests.helpers import KIMI_LINEAR_CONFIG_JSON, assert_rel_close

D = 32


def latent_config(**changes) -> K3Config:
    """K3 structure at toy width: latent MoE with norm, SiTU, 2 shared experts."""
    base = load_config("k3-tiny").replace(hidden_size=D, num_experts=8, num_experts_per_token=3, num_shared_experts=2,
                                          moe_intermediate_size=24, routed_expert_hidden_size=16)
    return base.replace(**changes)


def kimi_linear_config(**changes) -> K3Config:
    """Kimi-Linear structure at toy width: classic full-width MoE, SwiGLU, scaling 2.446."""
    cfg = K3Config.from_json(KIMI_LINEAR_CONFIG_JSON)
    small = {"hidden_size": D, "num_hidden_layers": 4, "kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_attention_heads": 2,
                 "num_key_value_heads": 2, "kda_num_heads": 2, "kda_head_dim": 16, "num_experts": 8, "num_experts_per_token": 3,
                 "moe_intermediate_size": 24}
    return cfg.replace(**small, **changes)


CONFIGS = {"latent": latent_config, "latent-nonorm": lambda: latent_config(latent_moe_use_norm=False),
           "kimi-linear": kimi_linear_config}


def randomized(moe: StableLatentMoE) -> StableLatentMoE:
    """Weights large enough that every path matters, and a nonzero selection bias."""
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe


def expert_forward(moe: StableLatentMoE, e: int, z: torch.Tensor) -> torch.Tensor:
    """Expert e of the stacked bank written out as its three official Linear weights."""
    w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
    return w2 @ moe.experts.act(w1 @ z, w3 @ z)


def dense_loop(moe: StableLatentMoE, x: torch.Tensor) -> torch.Tensor:
    """DESIGN §6 written token by token, routing recomputed independently of MoEGate."""
    cfg_k, rsf, renorm = moe.gate.top_k, moe.gate.routed_scaling_factor, moe.gate.renormalize
    out = []
    for xt in x.reshape(-1, x.shape[-1]):
        s = torch.sigmoid(moe.gate.weight @ xt)
        chosen = torch.topk(s + moe.gate.e_score_correction_bias, cfg_k).indices
        p = s[chosen] / (s[chosen].sum() if renorm else 1.0) * rsf
        z = moe.routed_expert_down_proj(xt) if moe.is_latent else xt
        acc = sum(p[j] * expert_forward(moe, int(e), z) for j, e in enumerate(chosen))
        if moe.is_latent:
            if moe.routed_expert_norm is not None:
                acc = moe.routed_expert_norm(acc)
            acc = moe.routed_expert_up_proj(acc)
        if moe.shared_experts is not None:
            acc = acc + moe.shared_experts(xt)
        out.append(acc)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_matches_dense_loop_outputs_and_grads(name):
    moe = randomized(StableLatentMoE(CONFIGS[name]()))
    x = torch.randn(2, 13, D, requires_grad=True)
    y = moe(x)
    xr = x.detach().clone().requires_grad_(True)
    ref = dense_loop(moe, xr)
    assert_rel_close(f"{name} out", ref, y, 1e-6)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *moe.parameters()], dy, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, [xr, *moe.parameters()], dy, allow_unused=True)
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for n, g, rg in zip(names, grads, ref_grads):
        if rg is None:  # an expert no token chose
            assert g is None or not g.any(), n
            continue
        assert_rel_close(f"{name} grad {n}", rg, g, 1e-5)
    assert ref_grads[names.index("gate.weight")].abs().sum() > 0  # the router learns through p


def test_parameter_names_are_official():
    k3 = load_config("k3")
    with torch.device("meta"):
        moe = StableLatentMoE(k3)
    shapes = {n: tuple(t.shape) for n, t in moe.state_dict().items()}
    assert shapes["gate.weight"] == (896, 7168) and shapes["gate.e_score_correction_bias"] == (896,)
    # stacked in memory; the checkpoint writes experts.{e}.w1.weight = w1[e] (tests/test_checkpoint.py)
    assert shapes["experts.w1"] == (896, 3072, 3584) and shapes["experts.w2"] == (896, 3584, 3072)
    assert shapes["experts.w3"] == (896, 3072, 3584)
    assert shapes["routed_expert_down_proj.weight"] == (3584, 7168)
    assert shapes["routed_expert_norm.weight"] == (3584,)
    assert shapes["routed_expert_up_proj.weight"] == (7168, 3584)
    assert shapes["shared_experts.gate_proj.weight"] == (6144, 7168)  # 3072 * 2 shared experts
    assert shapes["shared_experts.down_proj.weight"] == (7168, 6144)
    assert len(shapes) == 2 + 3 + 3 + 3
    kl = StableLatentMoE(kimi_linear_config())
    names = set(kl.state_dict())
    assert not any(n.startswith("routed_expert_") for n in names)
    assert kl.state_dict()["experts.w1"].shape[1:] == (24, D)
    assert "gate.e_score_correction_bias" not in dict(kl.named_parameters())  # a buffer: never trained


def test_matches_transformers_kimi_linear_moe():
    """Our classic-MoE path equals transformers 5.24's KimiLinearMoE given the same weights."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

    cfg = kimi_linear_config()
    moe = randomized(StableLatentMoE(cfg))
    hf = KimiLinearMoE(KimiLinearConfig(
        hidden_size=D, moe_intermediate_size=cfg.moe_intermediate_size, num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_token, n_shared_experts=cfg.num_shared_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=True, hidden_act="silu"))
    with torch.no_grad():
        hf.gate.weight.copy_(moe.gate.weight)
        hf.gate.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias)
        hf.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
        hf.experts.down_proj.copy_(moe.experts.w2)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf.shared_experts, n).weight.copy_(getattr(moe.shared_experts, n).weight)
    x = torch.randn(3, 11, D)
    assert_rel_close("vs transformers", hf(x), moe(x), 1e-6)


def test_bias_selects_but_does_not_weight():
    gate = MoEGate(latent_config())
    x = torch.randn(64, D)
    _w0, idx0 = gate(x)
    with torch.no_grad():
        gate.e_score_correction_bias[5] = 10.0  # expert 5 now wins every token's first slot
    w1, idx1 = gate(x)
    assert (idx1 == 5).any(-1).all() and not (idx0 == 5).all()
    assert not torch.equal(idx0.sort(-1).values, idx1.sort(-1).values)
    s = torch.sigmoid(x @ gate.weight.T)
    chosen = s.gather(-1, idx1)
    assert_rel_close("weights from unbiased scores", chosen / chosen.sum(-1, keepdim=True), w1, 1e-6)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_renormalization_and_scaling(renormalize):
    gate = MoEGate(latent_config(moe_renormalize=renormalize, routed_scaling_factor=2.446))
    x = torch.randn(40, D)
    w, idx = gate(x)
    s = torch.sigmoid(x @ gate.weight.T).gather(-1, idx)
    if renormalize:
        assert_rel_close("sum p = rsf", torch.full((40,), 2.446), w.sum(-1), 1e-6)
        assert_rel_close("renormalized", s / s.sum(-1, keepdim=True) * 2.446, w, 1e-6)
    else:
        assert_rel_close("raw scaled", s * 2.446, w, 1e-6)


def test_router_stays_fp32_and_records_only_in_training():
    moe = StableLatentMoE(latent_config()).to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.w1.dtype == torch.bfloat16
    x = torch.randn(2, 9, D, dtype=torch.bfloat16)
    moe.eval()
    assert moe(x).dtype == torch.bfloat16 and moe.gate.last_scores is None and moe.gate.expert_load is None
    moe.train()
    moe(x)
    assert moe.gate.last_scores.shape == (18, 8) and not moe.gate.last_scores.requires_grad
    assert moe.gate.expert_load.sum() == 18 * 3 and moe.gate.expert_load.shape == (8,)


def test_expert_bank_skips_idle_experts():
    moe = randomized(StableLatentMoE(latent_config()))
    z = torch.randn(6, moe.experts.w1.shape[-1])
    idx = torch.tensor([[1, 3, 6]] * 6)
    w = torch.rand(6, 3)
    out = moe.experts(z, w, idx)
    ref = sum(w[:, j:j + 1] * torch.stack([expert_forward(moe, e, zt) for zt in z]) for j, e in enumerate((1, 3, 6)))
    assert_rel_close("three active experts", ref, out, 1e-6)


def test_empty_batch():
    moe = StableLatentMoE(latent_config())
    y = moe(torch.randn(0, 5, D))
    assert y.shape == (0, 5, D)


def test_bad_input_is_a_clear_error():
    moe = StableLatentMoE(latent_config())
    with pytest.raises(ValueError, match="last dim 32"):
        moe(torch.randn(2, 3, D + 1))
    with pytest.raises(ValueError, match="num_experts"):
        StableLatentMoE(latent_config(num_experts=0))


def test_reset_parameters_restores_init():
    cfg = latent_config(num_experts=64)
    moe = randomized(StableLatentMoE(cfg))
    moe.reset_parameters()
    assert not moe.gate.e_score_correction_bias.any()
    assert torch.equal(moe.routed_expert_norm.weight, torch.ones(16))
    for name in ("gate.weight", "routed_expert_down_proj.weight", "shared_experts.up_proj.weight"):
        std = moe.get_parameter(name).std().item()
        assert abs(std - cfg.initializer_range) < 0.15 * cfg.initializer_range, (name, std)
    w1 = moe.experts.w1
    assert abs(w1.std().item() - cfg.initializer_range) < 0.05 * cfg.initializer_range
