"""Gated Multi-head Latent Attention with NoPE (SPEC §4).

Legend: B batch, T new tokens, S keys (cached + new), H heads, L kv_lora_rank (512), R the
unrotated key slot qk_rope_head_dim (64), N qk_nope_head_dim (128), V v_head_dim (128).

K3 uses no RoPE anywhere (position comes from KDA), but keeps the 64-d `k_pe` slot and the
(N+R)^-1/2 scale so checkpoints match the DeepSeek/Kimi layout (SPEC §12.4). The decode cache
per token and layer is only the normalized latent c (L) and k_pe (R).

Two attention paths over the same weights (config.mla_impl):
- "naive": expand the latent into per-head keys/values with kv_b_proj, then SDPA.
- "absorb" (DeepSeek-V3 `attn_impl="absorb"`): fold kv_b's key half into the query and its value
  half into the output, so attention runs against the cached latents directly; cheaper at decode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import MLAState
from k3.model.norm import RMSNorm

# The official code gives the two latent norms eps 1e-6, unlike every other norm (SPEC §3).
MLA_LATENT_NORM_EPS = 1e-6


class GatedMLA(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope_dim, self.pe_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        self.scale = (self.nope_dim + self.pe_dim) ** -0.5
        qk = H * (self.nope_dim + self.pe_dim)
        if config.q_lora_rank is None:  # Kimi Linear
            self.q_proj = nn.Linear(D, qk, bias=False)
        else:  # K3
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.latent_dim + self.pe_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, MLA_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent_dim, H * (self.nope_dim + self.v_dim), bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(D, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)

    # ------------------------------------------------------------------ projections
    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, H, N+R]"""
        if self.config.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:-1], self.num_heads, self.nope_dim + self.pe_dim)

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, L+R]: the normalized latent c and the unrotated k_pe (what is cached)."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.pe_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    # ------------------------------------------------------------------ attention
    def attend(self, q: torch.Tensor, lat: torch.Tensor, offset: int) -> torch.Tensor:
        """q [B, T, H, N+R] (new tokens at absolute positions offset..offset+T-1) against
        lat [B, S, L+R] (all keys 0..S-1, S = offset + T). Returns [B, T, H*V]."""
        T, S = q.shape[1], lat.shape[1]
        mask = None
        if not (offset == 0 and T == S):
            pos_q = torch.arange(T, device=q.device) + offset
            mask = torch.arange(S, device=q.device)[None, :] <= pos_q[:, None]  # [T, S]
        if self.config.mla_impl == "absorb":
            o = self._attend_absorbed(q, lat, mask)
        else:
            o = self._attend_naive(q, lat, mask)
        return o.flatten(2)

    def _attend_naive(self, q, lat, mask):
        B, S, H = lat.shape[0], lat.shape[1], self.num_heads
        c, k_pe = lat.split([self.latent_dim, self.pe_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(B, S, H, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, H, self.pe_dim)], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return o.transpose(1, 2)  # [B, T, H, V]

    def _attend_absorbed(self, q, lat, mask):
        H = self.num_heads
        c, k_pe = lat.split([self.latent_dim, self.pe_dim], dim=-1)
        w = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, self.latent_dim)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim:]  # [H, N, L], [H, V, L]
        q_nope, q_pe = q.split([self.nope_dim, self.pe_dim], dim=-1)
        q_lat = torch.einsum("bthn,hnl->bthl", q_nope, w_uk)
        scores = torch.einsum("bthl,bsl->bhts", q_lat, c) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
        scores = scores.float() * self.scale
        if mask is None:
            T = q.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(c.dtype)
        o_lat = torch.einsum("bhts,bsl->bthl", p, c)
        return torch.einsum("bthl,hvl->bthv", o_lat, w_uv)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                state: MLAState | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. Packed rows (cu_seqlens, B == 1) never attend across documents;
        with `state`, sequence n attends to its cached latents and they are extended in place."""
        q, lat = self.queries(x), self.latents(x)
        if cu_seqlens is None and state is None:
            o = self.attend(q, lat, offset=0)
        else:
            segments = _segments(x.shape[0], x.shape[1], cu_seqlens)
            if state is not None and len(state.latents) != len(segments):
                raise ValueError(f"MLA layer {self.layer_idx}: the cache holds {len(state.latents)} sequences, "
                                 f"the batch has {len(segments)}")
            o = x.new_empty(*x.shape[:2], self.num_heads * self.v_dim)
            for n, (b, start, end) in enumerate(segments):
                new = lat[b:b + 1, start:end]
                past = state.latents[n] if state is not None else new[0, :0]
                full = torch.cat([past.to(new.dtype), new[0]], dim=0)[None]
                if state is not None:
                    state.latents[n] = full[0]  # autograd kept, as KDA keeps its state's
                o[b:b + 1, start:end] = self.attend(q[b:b + 1, start:end], full, offset=past.shape[0])
        if self.config.mla_use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


def _segments(batch: int, length: int, cu_seqlens: torch.Tensor | None):
    """(row, start, end) per sequence: rows of a uniform batch, or the documents of a packed row."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
