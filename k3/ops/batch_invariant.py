"""Batch-invariant CPU arithmetic: a token's result does not depend on what else is in the batch.

Floating-point results of a fast kernel depend on the shape it is called with: the BLAS picks a
matrix-vector path for 1-3 rows and a blocked GEMM for more, softmax takes a scalar path for rows
shorter than a vector, and a few vectorized element-wise ops (sigmoid, silu, softplus, gelu) round
a tensor's tail elements differently from its body. So a token decoded alone, in a batch of eight, or verified
beside its drafts (DESIGN §11) lands on logits a few ulp apart, and a near-tied MoE route or argmax
turns that into a different token (docs/LOG.md, "Speculative decoding").

Inside `batch_invariant()` every such op is called in one shape class only, whatever the batch:
  - mm / addmm / bmm / mv get at least MIN_ROWS rows and columns (zeros appended, then dropped):
    every call takes the blocked GEMM, where an entry depends on its row and column alone;
  - softmax over the last dim gets at least MIN_KEYS entries (-inf appended): the vector body;
  - a depthwise 1-D convolution (KDA's short conv) runs tap by tap: the conv kernel vectorizes
    over time, so a decode step's single position took another path than a prefill's;
  - sigmoid, silu, softplus and gelu, whose vectorized forms round a tensor's tail elements
    differently from its body, run as formulas over exp, tanh, erfc, log1p and division, which
    give the same value in any position;
and the model's shape-dependent choices follow `enabled()`: MLA attends through the absorbed
(decode) form at every length, KDA runs its token-by-token recurrence at every length. With
this on, prefill, decode and speculative verification compute every token with the same
arithmetic, so greedy decoding with and without speculation agree token for token.

What it costs: row padding and the recurrent prefill make it slower; it is a mode for checks,
on-policy RL and reproducible serving, not the default. CPU only: CUDA kernels choose their
reductions by shape in ways no padding fixes (`check_device`). `tests/ops/test_batch_invariant.py`
checks each op's invariance on the machine it runs on.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MIN_ROWS = 16  # rows and columns of a product: this CPU's BLAS changes kernels below 4 rows, 12 columns
MIN_KEYS = 32  # above the softmax kernel's scalar path (rows shorter than 16)
SOFTPLUS_THRESHOLD = 20.0  # torch's default: above it softplus(x) == x in fp32
GELU_TANH_C = math.sqrt(2 / math.pi)
SQRT_HALF = math.sqrt(0.5)

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("k3_batch_invariant", default=False)
aten = torch.ops.aten


def enabled() -> bool:
    """Whether the calling code runs inside `batch_invariant()`."""
    return _active.get()


def check_device(device: torch.device | str) -> None:
    if torch.device(device).type != "cpu":
        raise ValueError(f"batch-invariant mode is CPU-only (on {torch.device(device).type}, kernels pick "
                         "their reductions by shape)")


def _pad(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """x with zeros appended along `dim` up to MIN_ROWS; and its size along `dim` before."""
    size = x.shape[dim]
    if size >= MIN_ROWS:
        return x, size
    shape = list(x.shape)
    shape[dim] = MIN_ROWS - size
    return torch.cat([x, x.new_zeros(shape)], dim=dim), size


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, rows = _pad(a, 0)
    b, cols = _pad(b, 1)
    return aten.mm.default(a, b)[:rows, :cols]


def _depthwise_1d(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups) -> bool:
    return (x.dim() == 3 and weight.dim() == 3 and weight.shape[1] == 1 and groups == x.shape[1] == weight.shape[0]
            and bias is None and not transposed and list(stride) == [1] and list(padding) == [0]
            and list(dilation) == [1])


@functools.cache
def _composite(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


class _BatchInvariantMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _composite(func):  # under inference_mode linear, einsum, matmul, softmax... arrive whole
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func is aten.mm.default:
            return _mm(*args)
        if func is aten.addmm.default:
            bias, a, b = args[:3]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            return beta * bias + alpha * _mm(a, b)
        if func is aten.bmm.default:
            a, rows = _pad(args[0], 1)
            b, cols = _pad(args[1], 2)
            return func(a, b)[:, :rows, :cols]
        if func is aten.mv.default:
            return _mm(args[0], args[1][:, None])[:, 0]
        if func is aten._softmax.default:
            x, dim, half_to_float = args
            dim = dim % x.dim()
            if dim == x.dim() - 1 and x.shape[-1] < MIN_KEYS:
                shape = (*x.shape[:-1], MIN_KEYS - x.shape[-1])
                padded = torch.cat([x, x.new_full(shape, float("-inf"))], dim=-1)
                return func(padded, dim, half_to_float)[..., : x.shape[-1]]
            return func(*args, **kwargs)
        if func is aten.convolution.default and _depthwise_1d(*args):
            x, weight = args[0], args[1]
            W, L = weight.shape[-1], x.shape[-1] - weight.shape[-1] + 1
            y = x[..., :L] * weight[:, :, 0]
            for w in range(1, W):  # tap by tap, the same order at every length
                y = y + x[..., w:w + L] * weight[:, :, w]
            return y
        if func is aten.sigmoid.default:
            return torch.reciprocal(1 + torch.exp(-args[0]))
        if func is aten.silu.default:
            return args[0] / (1 + torch.exp(-args[0]))
        if func is aten.softplus.default:
            x, beta, threshold = (list(args) + [1, SOFTPLUS_THRESHOLD])[:3]
            bx = x * beta
            return torch.where(bx > threshold, x, torch.log1p(torch.exp(bx)) / beta)
        if func is aten.gelu.default:
            x = args[0]
            if kwargs.get("approximate", args[1] if len(args) > 1 else "none") == "tanh":
                return 0.5 * x * (1 + torch.tanh(GELU_TANH_C * (x + 0.044715 * x * x * x)))
            return 0.5 * x * torch.erfc(-x * SQRT_HALF)  # erfc: no cancellation for x << 0
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Run the enclosed (CPU) code with batch-invariant arithmetic; `on=False` is a no-op, so
    callers can write `with batch_invariant(config.batch_invariant):`."""
    if not on:
        yield
        return
    token = _active.set(True)
    try:
        with _BatchInvariantMode():
            yield
    finally:
        _active.reset(token)


__all__ = ["MIN_KEYS", "MIN_ROWS", "batch_invariant", "check_device", "enabled"]
