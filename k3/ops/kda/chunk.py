"""KDA, chunkwise parallel, in plain torch: the CPU training/prefill path (SPEC §3, docs/KDA.md).

Shapes as in `k3.ops.kda.inputs`; C = chunk size, NC chunks. Inside a chunk, with cumulative
log-decay G_i = sum_{r<=i} g_r (per key channel) and S the state entering the chunk:

    A_kk[i,j] = beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])   j < i
    A_qk[i,j] =        sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])   j <= i
    (I + A_kk) [W | U] = [Diag(beta)(exp(G) * K) | Diag(beta) V]      (WY/UT form, one triangular solve)
    V' = U - W S ;  O = (exp(G) * Q) S + A_qk V' ;  S <- Diag(exp(G_C)) S + (exp(G_C - G) * K)^T V'

Everything but the last line is batched over all chunks at once; only the state recurrence loops
over chunks. All math is fp32. No exp of a positive argument ever happens: the pairwise decays are
built as exp(G_i - G_j) with the non-causal (j > i) entries set to -inf BEFORE exp, so they are
exactly 0 and their gradients too (masking after exp would give inf * 0 = NaN for large decays).
Cost of that exactness: a [B, H, T, C, K] fp32 decay tensor; a smaller chunk trades it for more
loop steps. T need not be a multiple of C: the last chunk is padded with q = k = v = 0, g = 0 (no
decay) and beta = 0 (no write), which changes no real output and no final state.
"""
from __future__ import annotations

import torch

from k3.ops.kda.inputs import check_kda_inputs
from k3.ops.varlen import pack, unpack

CHUNK_SIZES = (16, 32, 64)


def kda_chunk(
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
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None)."""
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"kda_chunk: chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[1]
    tensors = tuple(t.float() for t in (q, k, v, g, beta))
    if cu_seqlens is not None:  # packed sequences -> a zero-padded batch of N (padding is inert)
        tensors = tuple(unpack(t, cu_seqlens, multiple=chunk_size) for t in tensors)
    else:
        tensors = tuple(_pad_time(t, -T % chunk_size) for t in tensors)
    o, state = _chunked(*tensors, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
    o = pack(o, cu_seqlens) if cu_seqlens is not None else o[:, :T]
    return o.to(v.dtype), state if output_final_state else None


def _pad_time(x: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1) if extra else x


def _chunked(q, k, v, g, beta, *, scale: float, initial_state, chunk_size: int):
    """fp32 inputs with T a multiple of the chunk; returns (o [B, T, H, V], state [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, NC = chunk_size, T // chunk_size

    def chunks(x):  # [B, T, H, ...] -> [B, H, NC, C, ...]
        return x.reshape(B, NC, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q * scale), chunks(k), chunks(v), chunks(g)
    beta = chunks(beta)  # [B, H, NC, C, 1]
    G = g.cumsum(dim=-2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    # Pairwise decays exp(G_i - G_j) [B, H, NC, C(i), C(j), K], -inf before exp off the causal part.
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf")).exp()
    A_qk = torch.einsum("...ic,...ijc,...jc->...ij", q, decay, k)
    A_kk = torch.einsum("...ic,...ijc,...jc->...ij", k, decay, k) * beta * strict
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta * G.exp() * k, beta * v], dim=-1)
    w, u = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True).split([K, V], dim=-1)
    q_decayed = q * G.exp()  # reads the entering state through the decay so far
    k_to_end = k * (G[..., -1:, :] - G).exp()  # each write, decayed to the chunk's end
    chunk_decay = G[..., -1, :].exp()[..., None]  # [B, H, NC, K, 1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    for n in range(NC):
        v_new = u[:, :, n] - w[:, :, n] @ S  # the delta-rule corrections given the entering state
        outs.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ v_new)
        S = chunk_decay[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, C, V)  # [B, H, NC, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V), S
