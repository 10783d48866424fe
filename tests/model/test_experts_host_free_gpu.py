"""The routed experts and the MoE layer captured in one CUDA graph (`-m gpu`; skipped without CUDA):
in host-free mode (k3/ops/host_free.py) forward and backward capture once, and replays with other
tokens, hence other routing, equal eager runs. fp32 takes the padded batched GEMM; bf16 autocast
on sm90 the grouped GEMM. k3-1b's expert widths."""
from __future__ import annotations

import pytest
import torch

from k3.model.experts import RoutedExperts, grouped_mm_available
from k3.model.moe import StableLatentMoE
from k3.ops.host_free import host_free
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, EXACT, gpu_config, unit_scale_

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
N = 256


def routing(num_experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of N tokens that never picks every 7th expert (some experts get no rows)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(N, num_experts, generator=g)
    scores[:, 3::7] = -1.0
    return torch.rand(N, k, generator=g).to(CUDA), scores.topk(k, dim=-1).indices.to(CUDA)


def capture(step, static_inputs):
    """A CUDA graph of `step(*static_inputs)` in host-free mode (warmed up on a side stream, as
    torch.cuda.graphs asks), and its static outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), host_free():
        for _ in range(2):
            step(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), host_free():
        outs = step(*static_inputs)
    return graph, outs


def test_fp32_experts_graph_replays_equal_eager():
    """The fp32 bank (no grouped GEMM in fp32): y and the gradients of x, w1, w3, w2 and the
    routing weights from graph replays with three other routings against the eager per-expert loop."""
    cfg = gpu_config()
    bank = unit_scale_(RoutedExperts(cfg, cfg.moe_hidden_size, cfg.moe_intermediate_size)).to(CUDA)
    assert not grouped_mm_available(bank.w1)

    def step(x, weights, idx, dy):
        x, weights = x.detach().requires_grad_(), weights.detach().requires_grad_()
        y = bank(x, weights, idx)
        return [y, *torch.autograd.grad((y * dy).sum(), (x, bank.w1, bank.w3, bank.w2, weights))]

    x, dy = torch.randn(N, cfg.moe_hidden_size, device=CUDA), torch.randn(N, cfg.moe_hidden_size, device=CUDA)
    static = [x, *routing(cfg.num_experts, cfg.num_experts_per_token, seed=0), dy]
    graph, outs = capture(step, static)
    for seed in (1, 2, 3):
        fresh = [torch.randn_like(x), *routing(cfg.num_experts, cfg.num_experts_per_token, seed), torch.randn_like(dy)]
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        ref = step(*fresh)  # eager, outside host-free mode: the per-expert loop
        for name, r, o in zip(("y", "dx", "dw1", "dw3", "dw2", "dweights"), ref, outs, strict=True):
            assert_rel_close(f"{name} (routing {seed})", r, o, EXACT)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_moe_layer_graph_replays_equal_eager(autocast):
    """The whole layer in training mode (router, top-k, latent projections, norm, shared and routed
    experts, the balance record): output and input gradient of replays with new tokens, hence new
    routing, against eager host-free runs on the same card."""
    cfg = gpu_config()
    moe = unit_scale_(StableLatentMoE(cfg)).to(CUDA).train()

    def step(x, dy):
        x = x.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = moe(x)
        return [y, *torch.autograd.grad((y.float() * dy).sum(), (x,))]

    static = [torch.randn(1, N, cfg.hidden_size, device=CUDA), torch.randn(1, N, cfg.hidden_size, device=CUDA)]
    graph, outs = capture(step, static)
    for _ in range(2):
        fresh = [torch.randn_like(t) for t in static]
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        with host_free():
            ref = step(*fresh)
        for name, r, o in zip(("y", "dx"), ref, outs, strict=True):
            assert_rel_close(name, r.float(), o.float(), EXACT if not autocast else BF16_TOL)
