"""Quantization-aware training for the routed experts (DESIGN §9): MXFP4 weights, MXFP8 activations.

`apply_qat(model)` turns every routed-expert bank (`k3.model.experts.RoutedExperts`, stacked
w1/w3 [E, I, H] and w2 [E, H, I]) into an `MXQATExperts`, in place. Its forward
  - fake-quantizes w1, w3, w2 to MXFP4 (E2M1) with the K3 checkpoint rule e = ceil(log2(amax/6)),
    blocks of 32 along each matrix's input dim: exactly what `save_packed` writes per expert, so
    the exported model holds the trained weights bit for bit;
  - fake-quantizes the inputs of all three matmuls (x for w1/w3, the GLU output for w2) to MXFP8
    (E4M3) with the OCP floor rule, blocks of 32 along the input (reduction) dim: the on-the-fly
    activation cast of an MX GEMM;
  - passes gradients straight through both (STE): d fq(x) / dx := 1.
Attention, latent projections, shared experts, router and lm_head stay in high precision, and
the model code does not change: the bank exposes `weights()` / `inputs()` for exactly this.
The swap changes the module's class only, so every Parameter keeps its identity (an optimizer
built before `apply_qat` keeps working) and state-dict names do not move.

`reused_weight_quantization(model)` is for inference between weight updates (an RL rollout, an
evaluation): inside it, a forward without autograd quantizes each bank's weights once and reuses
them while the Parameters' version counters stand still (an optimizer step or a load_state_dict
moves them); gradient-mode forwards still quantize every time. On leaving it the copies go.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from k3.model.experts import RoutedExperts
from k3.quant.mx import BLOCK, ElementFormat, Rule, fake_quantize
from k3.quant.targets import INPUT_FORMAT, INPUT_RULE, WEIGHT_FORMAT, WEIGHT_RULE


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


def _quantize_input(x: torch.Tensor) -> torch.Tensor:
    return fake_quantize_ste(x, INPUT_FORMAT, INPUT_RULE)


def _glu_then_quantize(gate: torch.Tensor, up: torch.Tensor, *, act) -> torch.Tensor:
    """The GLU output is w2's input: it gets the same MXFP8 cast as x."""
    return _quantize_input(act(gate, up))


class MXQATExperts(RoutedExperts):
    """RoutedExperts computing with MXFP4 weights and MXFP8 matmul inputs, straight-through."""

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        params = (self.w1, self.w3, self.w2)
        reused = self.__dict__.get("_reused")
        if reused is None or torch.is_grad_enabled():
            return tuple(fake_quantize_ste(w, WEIGHT_FORMAT, WEIGHT_RULE) for w in params)
        # an in-place update (optimizer step, copy_) bumps _version; a rebound .data moves data_ptr
        key = tuple((w.data_ptr(), w._version) for w in params)
        if reused.get("key") != key:
            reused["weights"] = tuple(fake_quantize(w.detach(), WEIGHT_FORMAT, WEIGHT_RULE) for w in params)
            reused["key"] = key
        return reused["weights"]

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return _quantize_input(x)

    @classmethod
    def convert(cls, experts: RoutedExperts) -> None:
        """Make `experts` an MXQATExperts in place (same attributes, same Parameters)."""
        for name, w in (("w1", experts.w1), ("w3", experts.w3), ("w2", experts.w2)):
            if w.shape[-1] % BLOCK:
                raise ValueError(f"MX QAT needs expert input widths divisible by {BLOCK}; {name} is {tuple(w.shape)}")
        experts.__class__ = cls
        experts.act = functools.partial(_glu_then_quantize, act=experts.act)


@contextlib.contextmanager
def reused_weight_quantization(model: nn.Module):
    """Inside: autograd-free forwards quantize each QAT bank's weights once per weight version (see
    the module docstring); a model without QAT banks is untouched."""
    banks = [m for m in model.modules() if isinstance(m, MXQATExperts) and "_reused" not in m.__dict__]
    for bank in banks:  # nested: the outermost owns the copies
        bank.__dict__["_reused"] = {}
    try:
        yield
    finally:
        for bank in banks:
            bank.__dict__.pop("_reused", None)


def apply_qat(model: nn.Module) -> int:
    """Turn every routed-expert bank into MXQATExperts in place; returns how many were converted.
    Idempotent. Raises if the model has no routed experts (nothing would be quantized)."""
    banks = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    if not banks:
        raise ValueError("apply_qat: the model has no routed experts (block_sparse_moe.experts)")
    todo = [m for m in banks if not isinstance(m, MXQATExperts)]
    for experts in todo:
        MXQATExperts.convert(experts)
    return len(todo)
