"""KDA, chunkwise parallel, in plain torch: the CPU training/prefill path (DESIGN §3, docs/KDA.md).

Shapes as in `k3.ops.kda.inputs`; C = chunk size, NC chunks. Inside a chunk, with cumulative
log-decay G_i = sum_{r<=i} g_r (per key channel) and S the state entering the chunk:

    A_kk[i,j] = beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])   j < i
    A_qk[i,j] =        sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])   j <= i
    (I + A_kk) [W | U] = [Diag(beta)(exp(G) * K) | Diag(beta) V]      (WY/UT form, one triangular solve)
    V' = U - W S ;  O = (exp(G) * Q) S + A_qk V' ;  S <- Diag(exp(G_C)) S + (exp(G_C - G) * K)^T V'

Everything above the last line is batched over all chunks at once; only the last line (it needs S)
loops over chunks. All math is fp32, and with an unbounded gate no exp sees a positive argument: pairwise decays between
the two halves of a block factor through the earlier half's end (two factors <= 1, a matmul), halves
joined bottom up from 4-token blocks; inside those they are built as exp(G_i - G_j) with the
non-causal (j > i) entries set to -inf BEFORE exp, so they are exactly 0 and so are their gradients
(masking after exp would give inf * 0 = NaN for large decays). Memory: a [B, H, T, 4, K] fp32
tensor for those diagonal blocks. When the caller bounds every g from below (K3's gate: g > lb,
DESIGN §3), the diagonal blocks are matmuls too: rows decayed to and from the block's first token,
q_i exp(G_i - G_0) <= 1 and k_j exp(G_0 - G_j) <= exp((d - 1)|lb|), stay in fp32's range (fla's
"safe gate" reasoning), and a row still reads no later token's decay (prefix invariance).
T need not be a multiple of C: the last chunk is padded with q = k = v = 0, g = 0 (no
decay) and beta = 0 (no write), which changes no real output and no final state.
"""
from __future__ import annotations

import torch

from k3.ops.kda.inputs import check_kda_inputs
from k3.ops.varlen import pack, unpack

CHUNK_SIZES = (16, 32, 64)
DIAG = 4  # diagonal blocks with explicit pairwise decays; larger halves are matmuls (fastest on CPU)
MAX_FACTOR_EXP = 80.0  # largest exponent in a factored block: e^80 ~ 6e34, K of them summed stay under fp32's 3e38


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
    decay_floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None). `decay_floor`: a
    bound the caller guarantees, every g >= decay_floor (the lower-bounded gate's lb); None: any g <= 0."""
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
    o, state = _chunked(*tensors, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                        diag=factored_diag(chunk_size, decay_floor))
    o = pack(o, cu_seqlens) if cu_seqlens is not None else o[:, :T]
    return o.to(v.dtype), state if output_final_state else None


def _pad_time(x: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1) if extra else x


def factored_diag(chunk_size: int, decay_floor: float | None) -> int | None:
    """The largest diagonal block (>= 8 tokens) whose decays may factor through its first token
    under `decay_floor`, or None (explicit pairwise decays in DIAG-token blocks)."""
    if decay_floor is None:
        return None
    d = chunk_size
    while d >= 8 and (d - 1) * -decay_floor > MAX_FACTOR_EXP:
        d //= 2
    return d if d >= 8 else None


def _chunked(q, k, v, g, beta, *, scale: float, initial_state, chunk_size: int, diag: int | None = None):
    """fp32 inputs with T a multiple of the chunk; returns (o [B, T, H, V], state [B, H, K, V]).
    `diag`: the factored diagonal block size (`factored_diag`), None for the pairwise one."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, NC = chunk_size, T // chunk_size

    def chunks(x):  # [B, T, H, ...] -> [B, H, NC, C, ...]
        return x.reshape(B, NC, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q * scale), chunks(k), chunks(v), chunks(g)
    beta = chunks(beta)  # [B, H, NC, C, 1]
    G = g.cumsum(dim=-2)
    A_qk, A_kk = _intra_chunk_scores(q, k, G, diag)
    A_kk = A_kk * beta * torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta * G.exp() * k, beta * v], dim=-1)
    w, u = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True).split([K, V], dim=-1)
    q_decayed = q * G.exp()  # reads the entering state through the decay so far
    k_to_end = k * (G[..., -1:, :] - G).exp()  # each write, decayed to the chunk's end
    chunk_decay = G[..., -1, :].exp()[..., None]  # [B, H, NC, K, 1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    # unbind, not u[:, :, n]: each indexing's backward would zero-fill a whole [B, H, NC, ...] tensor
    for u_n, w_n, qd_n, a_n, decay_n, k_n in zip(*(t.unbind(2) for t in (u, w, q_decayed, A_qk, chunk_decay, k_to_end))):
        v_new = u_n - w_n @ S  # the delta-rule corrections given the entering state
        outs.append(qd_n @ S + a_n @ v_new)
        S = decay_n * S + k_n.transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, C, V)  # [B, H, NC, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V), S


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor,
                        diag: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, G [..., C, K] -> (A_qk, A_kk') [..., C, C], A_xk[i, j] = sum_c x_i[c] k_j[c] exp(G_i[c] - G_j[c])
    for j <= i and 0 above the diagonal (the caller drops A_kk's diagonal).

    Built bottom up by halves: between the two halves of a block of 2b tokens the decay factors
    through the last position r of the earlier half, exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j),
    both exponents <= 0, so that quadrant is one [b, K] x [K, b] matmul of once-decayed rows. Only
    DIAG-token blocks on the diagonal need explicit [DIAG, DIAG, K] pairwise decays. So the
    elementwise work is ~T * K * (DIAG + 2 log2(C / DIAG)) per head instead of T * K * C, and no exp
    sees a positive argument. q and k share every decay factor, so they go through stacked.
    With `diag` (a bounded gate, `factored_diag`), the diagonal blocks are diag tokens and matmuls
    of rows decayed to and from the block's first token instead.
    """
    C = q.shape[-2]
    d = min(diag or DIAG, C)
    x = torch.stack([q, k])  # [2, ..., C, K]
    xb, kb, Gb = (t.unflatten(-2, (C // d, d)) for t in (x, k, G))
    causal = torch.ones(d, d, dtype=torch.bool, device=q.device).tril()
    if diag:
        G_0 = Gb[..., :1, :]  # the block's first token: a row never reads a later token's decay
        A = ((xb * (Gb - G_0).exp()) @ (kb * (G_0 - Gb).exp()).transpose(-1, -2)).masked_fill(~causal, 0.0)
    else:
        decay = (Gb[..., :, None, :] - Gb[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf")).exp()
        # a sum, not a matmul: a [d, K] x [K, 1] bmm per row has a backward of tiny outer products
        A = (xb[..., :, None, :] * (decay * kb[..., None, :, :])).sum(-1)  # [2, ..., C/d, d, d]
    b = d
    while b < C:  # join sibling blocks of b tokens into blocks of 2b
        n = C // (2 * b)
        (_, x_late), (k_early, _), (G_early, G_late) = (t.unflatten(-2, (n, 2, b)).unbind(-3) for t in (x, k, G))
        G_r = G_early[..., -1:, :]  # [..., n, 1, K]: the earlier sibling's last cumulative decay
        k_early = k_early * (G_r - G_early).exp()  # each k_j decayed to r
        x_late = x_late * (G_late - G_r).exp()  # each x_i decayed from r
        cross = x_late @ k_early.transpose(-1, -2)  # [2, ..., n, b, b]
        A_early, A_late = A.unflatten(-3, (n, 2)).unbind(-3)
        top = torch.cat([A_early, torch.zeros_like(cross)], dim=-1)
        A = torch.cat([top, torch.cat([cross, A_late], dim=-1)], dim=-2)  # [2, ..., n, 2b, 2b]
        b *= 2
    A_qk, A_kk = A.squeeze(-3).unbind(0)
    return A_qk, A_kk
