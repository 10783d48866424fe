"""The LM head and its cross-entropy in one op, without the whole [N, V] logits at once.

    linear_cross_entropy(h, weight, labels)
      == F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=-100, reduction="sum")

h [N, D] (the final hidden states, bf16 or fp32), weight [V, D] (the LM head, fp32 under bf16
autocast in training), labels [N] int64 with -100 where a position has no target. Returns the
fp32 sum of the token losses (the trainer divides by the step's target count).

On CUDA with fla-core (the `cuda` extra) and gradients wanted: fla's fused kernel
(fla.modules.fused_linear_cross_entropy), which walks the tokens in chunks and computes the
gradients of h and the weight during the forward, so the backward only scales them. It reads no
device value on the host (the target count stays a device tensor), so a CUDA graph can capture
it (k3/ops/host_free.py). Under autocast its chunk GEMMs run in bf16 like `lm_head(h)` does.
Elsewhere: the torch reference, `chunk` tokens at a time, fp32 logits per chunk, each chunk's
logits recomputed in the backward (activation checkpointing) rather than kept.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from k3.ops import fla_kernels

IGNORE_INDEX = -100


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   chunk: int = 4096) -> torch.Tensor:
    """The torch formulation: the sum of per-chunk losses; each chunk is checkpointed when a
    gradient is wanted, so only one chunk's [chunk, V] logits live at a time."""
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk):
        part = (h[start:start + chunk], weight, labels[start:start + chunk])
        total = total + (checkpoint(_chunk_loss, *part, use_reentrant=False) if grad else _chunk_loss(*part))
    return total


def fla_path_available(h: torch.Tensor) -> bool:
    """fla's fused kernel can run on h: CUDA, with fla-core (and so triton) importable."""
    return h.is_cuda and fla_kernels.available()


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk: int = 4096) -> torch.Tensor:
    """sum of cross_entropy(h @ weight.T, labels), labels == -100 skipped: fp32 scalar (module docstring).
    `chunk`: tokens per chunk of the torch reference (fla sizes its own chunks)."""
    if h.dim() != 2 or labels.shape != h.shape[:1] or weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"linear_cross_entropy expects h [N, D], weight [V, D], labels [N]; got "
                         f"{tuple(h.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    # without gradients the fused kernel's in-forward backward would be wasted work
    if grad and fla_path_available(h):
        from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

        return fused_linear_cross_entropy_loss(h, labels, weight, ignore_index=IGNORE_INDEX, reduction="sum")
    return linear_cross_entropy_reference(h, weight, labels, chunk)
