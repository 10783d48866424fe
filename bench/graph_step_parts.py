"""Two parts of the capturable training step on one GPU: the routed experts in fp32 (per-expert
loop, the host-free padded bmm eager, and that captured in a CUDA graph) and the LM-head loss
(lm_head(h).float() + cross-entropy against fla's fused kernel, bf16 autocast over fp32 weights).
Forward + backward each; do_bench medians and peak memory above the inputs.

    python -m bench.graph_step_parts [--tokens 2048] [--vocab 163840]
"""
from __future__ import annotations

import argparse

import torch
import triton.testing
from torch.nn import functional as F

from bench.common import graphed
from k3.config import load_config
from k3.model.experts import RoutedExperts
from k3.ops.host_free import host_free
from k3.ops.linear_cross_entropy import linear_cross_entropy


def measure(fn) -> tuple[float, float]:
    """(median ms, peak MiB allocated during one call above what was allocated before)."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return triton.testing.do_bench(fn), peak


def experts(n: int) -> None:
    cfg = load_config("k3-1b")
    bank = RoutedExperts(cfg, cfg.moe_hidden_size, cfg.moe_intermediate_size).cuda()
    bank.reset_parameters()
    x, dy = torch.randn(n, cfg.moe_hidden_size, device="cuda"), torch.randn(n, cfg.moe_hidden_size, device="cuda")
    weights = torch.rand(n, cfg.num_experts_per_token, device="cuda")
    idx = torch.rand(n, cfg.num_experts, device="cuda").topk(cfg.num_experts_per_token, -1).indices

    def step():
        xg = x.detach().requires_grad_()
        (bank(xg, weights, idx) * dy).sum().backward()

    def host_free_step():
        with host_free():
            step()

    graph, _ = graphed(host_free_step)
    print(f"routed experts, k3-1b widths (E {cfg.num_experts}, k {cfg.num_experts_per_token}, "
          f"H {cfg.moe_hidden_size}, I {cfg.moe_intermediate_size}), N {n}, fp32, fwd+bwd:")
    for name, fn in (("per-expert loop", step), ("padded bmm, eager", host_free_step),
                     ("padded bmm, graph replay", graph.replay)):
        ms, mib = measure(fn)
        print(f"  {name:26s} {ms:8.3f} ms  peak +{mib:8.1f} MiB")


def head(n: int, vocab: int) -> None:
    d = load_config("k3-1b").hidden_size
    h = torch.randn(n, d, device="cuda", requires_grad=True)
    weight = (torch.randn(vocab, d, device="cuda") * d ** -0.5).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")

    def run(loss_fn):
        def call():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(h, weight, labels)
            torch.autograd.grad(loss, (h, weight))
        return call

    plain = run(lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100, reduction="sum"))
    print(f"LM head + cross-entropy, N {n}, D {d}, V {vocab}, bf16 autocast over fp32 weights, fwd+bwd:")
    for name, fn in (("lm_head(h).float() + CE", plain), ("fla fused (linear_cross_entropy)", run(linear_cross_entropy))):
        ms, mib = measure(fn)
        print(f"  {name:34s} {ms:8.3f} ms  peak +{mib:8.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=163840)
    args = parser.parse_args()
    experts(args.tokens)
    head(args.tokens, args.vocab)


if __name__ == "__main__":
    main()
