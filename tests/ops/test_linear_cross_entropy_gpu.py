"""fla's fused LM head + cross-entropy (k3/ops/linear_cross_entropy.py) on CUDA (`-m gpu`; skipped
without CUDA or fla+triton): under bf16 autocast with fp32 weights, as training runs the head, it
and the trainer's formula both stay within the bf16 bar of the fp32 loss and gradients; and a CUDA
graph of it, replayed with other tokens and labels, equals eager runs."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from k3.ops import fla_kernels
from k3.ops.linear_cross_entropy import fla_path_available, linear_cross_entropy
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, EXACT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_kernels.available(), reason="needs fla-core with triton")]
CUDA = torch.device("cuda")
N, D, V = 2048, 1024, 32768


def head_inputs(seed: int):
    """h [N, D] fp32, weight [V, D] fp32 (unit-scale logits), labels [N] with 1/8 ignored."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    h = torch.randn(N, D, device=CUDA, generator=g)
    weight = torch.randn(V, D, device=CUDA, generator=g) * D ** -0.5
    labels = torch.randint(0, V, (N,), device=CUDA, generator=g)
    labels[::8] = -100
    return h, weight, labels


def loss_and_grads(loss_fn, h, weight, labels, autocast: bool):
    h, weight = h.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(h, weight, labels)
    return [loss, *torch.autograd.grad(loss, (h, weight))]


def plain(h, weight, labels):
    """The trainer's formula: lm_head(h).float() then cross-entropy."""
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=-100, reduction="sum")


def test_fla_path_within_bf16_bar_of_fp32():
    h, weight, labels = head_inputs(0)
    assert fla_path_available(h)
    ref = loss_and_grads(plain, h, weight, labels, autocast=False)
    for label, fn in (("fla", linear_cross_entropy), ("trainer formula", plain)):
        out = loss_and_grads(fn, h, weight, labels, autocast=True)
        assert out[0].dtype == torch.float32
        for name, r, o in zip(("loss", "dh", "dweight"), ref, out, strict=True):
            assert_rel_close(f"{label} {name}", r, o.float(), BF16_TOL)


def test_fla_path_graph_replays_equal_eager():
    static = list(head_inputs(0))

    def step(h, weight, labels):
        return loss_and_grads(linear_cross_entropy, h, weight, labels, autocast=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles the Triton kernels outside the capture
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*static)
    for seed in (1, 2):
        fresh = head_inputs(seed)
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        ref = step(*fresh)
        for name, r, o in zip(("loss", "dh", "dweight"), ref, outs, strict=True):
            assert_rel_close(f"{name} (seed {seed})", r, o, EXACT)
