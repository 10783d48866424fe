"""The routed experts and the MoE layer on CUDA (`-m gpu`; skipped without CUDA): the bf16 grouped
GEMM (torch._grouped_mm, sm90) against the per-expert loop, and the layer under bf16 autocast with
fp32 parameters, as training runs it. k3-1b's expert widths."""
from __future__ import annotations

import copy

import pytest
import torch

from k3.model import experts as experts_module
from k3.model.experts import RoutedExperts
from k3.model.moe import StableLatentMoE
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, gpu_config, unit_scale_

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def routing(n: int, num_experts: int, k: int):
    """Random top-k routing of n tokens that never picks every 7th expert, so some groups are empty:
    weights [n, k] (softmax), expert ids [n, k]."""
    scores = torch.rand(n, num_experts)
    scores[:, 3::7] = -1.0
    return torch.softmax(torch.randn(n, k), dim=-1).to(CUDA), scores.topk(k, dim=-1).indices.to(CUDA)


def experts_pass(bank: RoutedExperts, x, weights, idx, dy):
    """y and the gradients of x, w1, w3, w2 of <y, dy>."""
    x = x.detach().clone().requires_grad_()
    y = bank(x, weights, idx)
    return [y, *torch.autograd.grad((y.float() * dy).sum(), (x, bank.w1, bank.w3, bank.w2))]


@pytest.mark.parametrize("against", ["fp32-loop", "bf16-loop"])
def test_experts_bf16_dispatch_matches_per_expert_loop(against, monkeypatch):
    """The bank in bf16 as dispatch picks its path (grouped_mm where sm90 makes it eligible) against
    the per-expert loop in fp32 (the reference) or in bf16 (the same rounding, another schedule):
    outputs and the gradients of x, w1, w3, w2, 4096 tokens."""
    cfg = gpu_config()
    bank = unit_scale_(RoutedExperts(cfg, cfg.moe_hidden_size, cfg.moe_intermediate_size)).to(CUDA)
    n = 4096
    x, dy = torch.randn(n, cfg.moe_hidden_size, device=CUDA), torch.randn(n, cfg.moe_hidden_size, device=CUDA)
    weights, idx = routing(n, cfg.num_experts, cfg.num_experts_per_token)
    bank16 = copy.deepcopy(bank).to(torch.bfloat16)
    fast = experts_pass(bank16, x.bfloat16(), weights, idx, dy)
    monkeypatch.setattr(experts_module, "grouped_mm_available", lambda x: False)
    ref = experts_pass(bank, x, weights, idx, dy) if against == "fp32-loop" else \
        experts_pass(bank16, x.bfloat16(), weights, idx, dy)
    for name, r, out in zip(("y", "dx", "dw1", "dw3", "dw2"), ref, fast, strict=True):
        assert_rel_close(name, r.float(), out.float(), BF16_TOL)


def test_moe_router_scores_in_fp32_under_autocast():
    """DESIGN §6: the router scores in fp32 whatever the autocast, so bf16 autocast picks exactly the
    experts fp32 picks, token by token."""
    cfg = gpu_config()
    moe = StableLatentMoE(cfg).to(CUDA)
    x = torch.randn(2 * 512, cfg.hidden_size, device=CUDA)
    with torch.no_grad():
        _, idx_ref = moe.gate(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, idx = moe.gate(x)
    changed = (idx.sort(-1).values != idx_ref.sort(-1).values).any(-1).float().mean().item()
    assert changed == 0.0, f"{changed:.1%} of tokens routed to other experts than under fp32"


def test_moe_with_fp32_parameters_under_autocast_matches_fp32():
    """Every expert chosen (no discrete choice left): the layer under bf16 autocast, its routed
    experts then seeing bf16 activations and fp32 weights, against the fp32 layer."""
    cfg = gpu_config()
    dense = StableLatentMoE(cfg.replace(num_experts_per_token=cfg.num_experts)).to(CUDA)
    x = torch.randn(2, 512, cfg.hidden_size, device=CUDA)
    with torch.no_grad():
        ref = dense(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = dense(x)
    assert_rel_close("y", ref, out.float(), BF16_TOL)
