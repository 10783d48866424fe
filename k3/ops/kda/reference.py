"""KDA, token by token: the readable reference every faster path is tested against (DESIGN §3).

Shapes as in `k3.ops.kda.inputs`. Per head, with state S [K, V] in fp32:

    S <- Diag(exp(g_t)) S                 # decay first (per key channel)
    u <- beta_t (v_t - S^T k_t)           # delta rule: correct what S predicts for k_t
    S <- S + k_t u^T
    o_t = S^T (scale q_t)                 # read the post-update state
"""
from __future__ import annotations

import torch

from k3.ops.kda.inputs import check_kda_inputs
from k3.ops.varlen import seq_lengths


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None)."""
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        o, state = _recurrence(q, k, v, g, beta, scale, initial_state)
    else:  # one sequence at a time, each from its own initial state
        outs, states, start = [], [], 0
        for n, length in enumerate(seq_lengths(cu_seqlens)):
            span = slice(start, start + length)
            s0 = None if initial_state is None else initial_state[n:n + 1]
            o_n, s_n = _recurrence(q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span], scale, s0)
            outs.append(o_n)
            states.append(s_n)
            start += length
        o, state = torch.cat(outs, dim=1), torch.cat(states)
    return o.to(v.dtype), state if output_final_state else None


def _recurrence(q, k, v, g, beta, scale: float, initial_state):
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        k_t = k[:, t]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t[..., None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, v.shape[-1])
    return o, S
