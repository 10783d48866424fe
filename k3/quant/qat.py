"""Quantization-aware training for the routed experts (SPEC §9): MXFP4 weights, MXFP8 activations.

`apply_qat(model)` replaces every routed-expert nn.Linear (`...block_sparse_moe.experts.{e}.w1/w2/
w3`, k3/quant/targets.py) by `MXQATLinear`, which keeps the SAME weight Parameter (optimizers built
before the swap keep working) and in its forward
  - fake-quantizes the weight to MXFP4 (E2M1) with the K3 checkpoint rule e = ceil(log2(amax/6)),
    blocks of 32 along the input dim: exactly what `save_packed` writes, so the exported model
    holds the trained weights bit for bit;
  - fake-quantizes the input to MXFP8 (E4M3) with the OCP floor rule, blocks of 32 along the
    input (reduction) dim: the on-the-fly activation cast of an MX GEMM (torchao's default);
  - passes gradients straight through both (STE): d fq(x) / dx := 1.
Everything else (attention, latent projections, shared experts, router, lm_head) stays in high
precision and the model code does not change. `reset_parameters` still finds these modules: they
are nn.Linear.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from k3.quant.mx import BLOCK, ElementFormat, Rule, fake_quantize
from k3.quant.targets import INPUT_FORMAT, INPUT_RULE, WEIGHT_FORMAT, WEIGHT_RULE, is_routed_expert_linear


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: the exact fake-quantized values (not x + (q - x).detach(), which can round off q).
    Backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: ElementFormat, rule: Rule) -> torch.Tensor:
        return fake_quantize(x, fmt, rule)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def fake_quantize_ste(x: torch.Tensor, fmt: ElementFormat, rule: Rule) -> torch.Tensor:
    return _FakeQuantSTE.apply(x, fmt, rule)


class MXQATLinear(nn.Linear):
    """y = fq_E4M3(x) @ fq_MXFP4(W)^T (+ bias), straight-through gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = fake_quantize_ste(self.weight, WEIGHT_FORMAT, WEIGHT_RULE)
        x = fake_quantize_ste(x, INPUT_FORMAT, INPUT_RULE)
        return F.linear(x, w, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "MXQATLinear":
        if linear.in_features % BLOCK:
            raise ValueError(f"MX QAT needs in_features divisible by {BLOCK}, got {linear.in_features}")
        with torch.device("meta"):  # no throwaway allocation; the original parameters are moved in
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight = linear.weight
        new.bias = linear.bias
        return new


def apply_qat(model: nn.Module) -> int:
    """Swap the routed experts' linears for MXQATLinear in place; returns how many were swapped.
    Idempotent. Raises if the model has no routed experts (nothing would be quantized)."""
    targets = [(name, m) for name, m in model.named_modules()
               if is_routed_expert_linear(name) and type(m) is nn.Linear]
    already = sum(isinstance(m, MXQATLinear) for m in model.modules())
    if not targets and not already:
        raise ValueError("apply_qat: the model has no routed-expert linears (block_sparse_moe.experts.{e}.w1/w2/w3)")
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, MXQATLinear.from_linear(linear))
    return len(targets)
