"""The routed experts' host-free path (k3/ops/host_free.py): the padded batched GEMM equals the
per-expert loop, and the whole MoE layer runs forward and backward without a host read (on fake
tensors, where any read of a value or value-sized output raises). The CUDA-graph capture:
tests/model/test_experts_host_free_gpu.py."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from k3.config import load_config
from k3.model.experts import RoutedExperts
from k3.model.moe import StableLatentMoE
from k3.ops.host_free import host_free
from k3.quant.qat import MXQATExperts
from tests.helpers import assert_rel_close
from tests.model.test_moe import kimi_linear_config, latent_config

EXACT = 1e-6


def routing(n: int, num_experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing that never picks every 3rd expert (some experts get no rows)."""
    scores = torch.rand(n, num_experts)
    scores[:, 1::3] = -1.0
    return torch.rand(n, k), scores.topk(k, dim=-1).indices


def bank_pass(bank: RoutedExperts, x, weights, idx, dy) -> list[torch.Tensor]:
    """y and the gradients of x, w1, w3, w2 and the routing weights of <y, dy>."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = bank(x, weights, idx)
    return [y, *torch.autograd.grad((y * dy).sum(), (x, bank.w1, bank.w3, bank.w2, weights))]


@pytest.mark.parametrize("act,qat", [("situ", False), ("silu", False), ("situ", True)], ids=["situ", "silu", "qat"])
def test_padded_bmm_equals_per_expert_loop(act, qat):
    """Outputs and every gradient, experts with no rows included; a QAT bank (its own weights,
    inputs and GLU) takes the same path."""
    cfg = latent_config(hidden_act=act, num_experts=8, num_experts_per_token=3)
    width = 32 if qat else cfg.moe_hidden_size  # MX blocks need widths divisible by 32
    bank = RoutedExperts(cfg, width, cfg.moe_intermediate_size if not qat else 32)
    with torch.no_grad():
        for w in (bank.w1, bank.w3, bank.w2):
            w.normal_(0, w.shape[-1] ** -0.5)
    if qat:
        MXQATExperts.convert(bank)
    n = 13
    x, dy = torch.randn(n, width), torch.randn(n, width)
    weights, idx = routing(n, cfg.num_experts, cfg.num_experts_per_token)
    ref = bank_pass(bank, x, weights, idx, dy)
    with host_free():
        out = bank_pass(bank, x, weights, idx, dy)
    for name, r, o in zip(("y", "dx", "dw1", "dw3", "dw2", "dweights"), ref, out, strict=True):
        assert_rel_close(name, r, o, EXACT)
    assert (out[2][1::3] == 0).all(), "experts with no rows must get zero gradients"


def test_overfull_expert_is_caught_on_device():
    """Capacity N relies on top-k naming distinct experts per token; a row naming one twice trips
    the device-side check instead of spilling into the next expert."""
    cfg = latent_config()
    bank = RoutedExperts(cfg, cfg.moe_hidden_size, cfg.moe_intermediate_size)
    idx = torch.tensor([[0, 0], [0, 1]])
    with host_free(), pytest.raises(RuntimeError, match="capacity"):
        bank(torch.randn(2, cfg.moe_hidden_size), torch.ones(2, 2), idx)


@pytest.mark.parametrize("make", [latent_config, kimi_linear_config], ids=["latent", "kimi-linear"])
def test_moe_layer_reads_no_device_value(make):
    """Router, top-k, renormalization, latent projections, norm, shared experts, routed experts and
    the balance record, forward and backward, on fake tensors (no values: .tolist()/.item() raise
    DataDependentOutputException, value-sized outputs DynamicOutputShapeException). Outside
    host-free mode the loop's host read fails the same pass, so the check does see host reads."""
    with FakeTensorMode():
        moe = StableLatentMoE(make()).train()
        x = torch.randn(2, 5, moe.hidden_size, requires_grad=True)
        with host_free():
            moe(x).sum().backward()
        assert x.grad.shape == x.shape and moe.experts.w1.grad is not None
        with pytest.raises(DataDependentOutputException):
            moe(x)


def test_k3_tiny_bank_capacity_is_tokens():
    """The padded buffer holds N rows per expert: every row of a batch routed to one expert fits."""
    cfg = load_config("k3-tiny")
    bank = RoutedExperts(cfg, cfg.moe_hidden_size, cfg.moe_intermediate_size)
    bank.reset_parameters()
    x = torch.randn(6, cfg.moe_hidden_size)
    idx = torch.stack([torch.zeros(6, dtype=torch.long), torch.arange(1, 7)], 1)  # expert 0 gets every token
    ref = bank(x, torch.ones(6, 2), idx)
    with host_free():
        assert_rel_close("y", ref, bank(x, torch.ones(6, 2), idx), EXACT)
