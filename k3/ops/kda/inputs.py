"""The KDA op contract, shared by every backend (fla's layout, DESIGN §3).

B batch, T tokens, H heads, K key dim, V value dim, N sequences (B, or len(cu_seqlens) - 1).
    q, k  [B, T, H, K]   (q unscaled: `scale`, default K^-1/2, is applied inside)
    v     [B, T, H, V]
    g     [B, T, H, K]   log-decay per key channel, already activated (<= 0)
    beta  [B, T, H]      delta-rule write strength in (0, 1)
    state [N, H, K, V]   fp32, key-first (fla's default layout, `state_v_first=False`)
q and k are L2-normalized over K (`l2_normalize`), by the caller or, with `normalize_qk=True`,
by the op itself (k3.ops.kda).
"""
from __future__ import annotations

import torch

from k3.ops.varlen import check_cu_seqlens


def check_kda_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> int:
    """Raise a ValueError naming the offending tensor; return N, the number of sequences."""
    if q.dim() != 4:
        raise ValueError(f"kda: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"kda: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"kda: g must be per key channel, shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"kda: v must be [B={B}, T={T}, H={H}, V], got shape {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"kda: beta must be [B={B}, T={T}, H={H}], got shape {tuple(beta.shape)}")
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"kda: initial_state must be [N={N}, H={H}, K={K}, V={v.shape[-1]}], "
                         f"got shape {tuple(initial_state.shape)}")
    return N


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (KDA q/k, DESIGN §3; fla's `l2norm`, same eps)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
