"""Fused input projections for inference: the Linear layers of a mixer that read the same input
run as one GEMM over their concatenated weights, then split along the output (DESIGN §14.3: a
transform serving applies to a built model).

Each Linear's weight becomes a row block, a contiguous view, of one [sum of outputs, in] matrix: its
Parameter object, name, shape and values stay, and the memory is not doubled, so state_dict,
save_pretrained and in-place loads (`load_state_dict`, `copy_`) see the model as before. Only
forwards without autograd take the fused GEMM; under autograd the layers call each Linear as
before, so training's kernels and gradients do not change. A model whose Parameters were replaced
afterwards (`.to()` to another dtype or device, `load_state_dict(assign=True)`, a deep copy) no
longer shares the matrix: its layers then run unfused (`FusedProjection.intact`), still exact.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def unfusable(linears: Sequence[nn.Module]) -> str | None:
    """Why these modules cannot share one GEMM, or None when they can."""
    for m in linears:
        # a subclass (a quantized or fake-quantized Linear) may not compute F.linear of its weight
        if type(m) is not nn.Linear:
            return f"{type(m).__name__} is not a plain nn.Linear"
        if m.bias is not None:  # one bias-free GEMM; no projection of either mixer has a bias
            return "a projection has a bias"
    if any(type(m.weight.data) is not torch.Tensor for m in linears):  # a sharded (DTensor) or subclassed weight
        return "the weights are not plain tensors"
    first = linears[0].weight
    if any(m.weight.dtype != first.dtype or m.weight.device != first.device or m.in_features != linears[0].in_features
           for m in linears):
        return "the projections differ in dtype, device or input width"
    if first.device.type == "meta":
        return "the weights are on the meta device"
    return None


class FusedProjection:
    """One GEMM for the Linear layers `names` of `owner`, which all read the same input: calling it
    on x gives their outputs side by side, in the order of `names` (the caller splits it into views)."""

    def __init__(self, owner: nn.Module, names: Sequence[str]):
        linears = [getattr(owner, n) for n in names]
        reason = unfusable(linears)
        if reason is not None:
            raise ValueError(f"cannot fuse {', '.join(names)}: {reason}")
        self.names = tuple(names)
        self.sizes = tuple(m.out_features for m in linears)
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in linears])
        offset = 0
        for m, n in zip(linears, self.sizes, strict=True):
            m.weight.data = self.weight[offset:offset + n]  # same Parameter object, now a view of the matrix
            offset += n
        self._linears = linears
        self._warned = False

    def intact(self) -> bool:
        """Whether every Linear still reads its rows of the fused matrix (see the module docstring)."""
        base, row = self.weight.data_ptr(), self.weight.stride(0) * self.weight.element_size()
        offsets = [0]
        for n in self.sizes[:-1]:
            offsets.append(offsets[-1] + n)
        ok = all(m.weight.data_ptr() == base + o * row for m, o in zip(self._linears, offsets, strict=True))
        if not ok and not self._warned:
            self._warned = True
            log.warning("fused projections %s no longer share their matrix (the Parameters were replaced): "
                        "running them unfused", "|".join(self.names))
        return ok

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def fuse_layer_inputs(layer: nn.Module, kind: str) -> str:
    """Give `layer` (KDA or MLA) one FusedProjection over its `input_projections()`, unless one of
    them cannot be fused; returns what it did, one line."""
    names = layer.input_projections()
    reason = unfusable([getattr(layer, n) for n in names])
    if reason is not None:
        return f"{kind} kept unfused ({reason})"
    layer._fused = FusedProjection(layer, names)
    return f"{kind} {'|'.join(n.removesuffix('_proj') for n in names)} fused (1 GEMM, was {len(names)})"


def active(fused: FusedProjection | None) -> FusedProjection | None:
    """`fused` when a forward may use it: no autograd (training keeps its separate GEMMs) and the
    matrix still shared. The host-side check is skipped while dynamo traces (it runs only eager)."""
    if fused is None or torch.is_grad_enabled():
        return None
    if not torch.compiler.is_compiling() and not fused.intact():
        return None
    return fused


def fuse_projections(model: nn.Module) -> list[str]:
    """Fuse the input projections of every mixer of `model` (a K3ForCausalLM) that offers it
    (`fuse_input_projections`), in place; returns one line per kind of outcome, for the log."""
    outcomes: dict[str, list[int]] = {}
    for layer in model.model.layers:
        mixer = layer.self_attn
        if hasattr(mixer, "fuse_input_projections"):
            outcomes.setdefault(mixer.fuse_input_projections(), []).append(layer.layer_idx)
    return [f"{what}: layers {', '.join(map(str, idx))}" for what, idx in outcomes.items()]
