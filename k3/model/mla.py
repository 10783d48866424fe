"""Gated Multi-head Latent Attention with NoPE (DESIGN §4).

Legend: B batch, T new tokens, S keys (cached + new), H heads, L kv_lora_rank (512), R the
unrotated key slot qk_rope_head_dim (64), N qk_nope_head_dim (128), V v_head_dim (128).

K3 uses no RoPE anywhere (position comes from KDA), but keeps the 64-d `k_pe` slot and the
(N+R)^-1/2 scale so checkpoints match the DeepSeek/Kimi layout (DESIGN §12.4). The decode cache
per token and layer is only the normalized latent c (L) and k_pe (R).

`mla_use_nope: false` (no published K3 or Kimi Linear config sets it; an ablation, docs/LOG.md
"RL and distillation") rotates q_pe and k_pe by their positions in the document (rotate-half
RoPE, `rope_theta`), DeepSeek's decoupled RoPE: k_pe is cached rotated, so every cached path
(decode, chunked prefill, prefix reuse) only needs each new token's position.

Two attention paths over the same weights (config.mla_impl):
- "naive": expand the latent into per-head keys/values with kv_b_proj, then SDPA.
- "absorb" (DeepSeek-V3 `attn_impl="absorb"`): fold kv_b's key half into the query and its value
  half into the output, so attention runs against the cached latents directly; cheaper at decode.
- "auto" (the default): absorbed for one-token queries, naive otherwise, as DeepSeek-V3 and vLLM's
  MLA backends split decode from prefill. A decode step's cost is then one read of each cached
  latent, not kv_b_proj over the whole cache; a prefill's attention runs in the smaller per-head
  dims (N+R, V instead of L+R, L) on the flash backend.
With a cache (k3/model/cache.py MLAState), a uniform batch [B, T] continues its B sequences in one
batched attention over the padded latent buffer; in a packed row the one-token documents attend
as one batch and each longer document alone. In host-free mode (a captured serving step) the
packed row's hints `decode_rows` and `chunk` fix the shapes instead: the decode rows as one [d, 1]
batch, the rest as a padded [N - d, chunk] grid, each against its whole buffer row, masked.
Without a cache a packed row runs one attention per document, except in host-free mode
(k3.ops.host_free): there it is one attention over the whole row with a block-diagonal causal mask
built on the device (`_document_mask`), dense [T, T] (O(T^2) per layer: rows up to ~16K tokens),
or [segment, segment] per segment of a row of whole training windows.
"""
from __future__ import annotations

from contextlib import nullcontext
from itertools import accumulate, pairwise

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from k3.config import K3Config
from k3.model.cache import MLAState
from k3.model.fusion import FusedProjection, active, fuse_layer_inputs
from k3.model.norm import RMSNorm
from k3.ops import batch_invariant, host_free
from k3.ops.varlen import seq_lengths, token_documents

# The official code gives the two latent norms eps 1e-6, unlike every other norm (DESIGN §3).
MLA_LATENT_NORM_EPS = 1e-6

# Attention with a mask only happens against a cache (a first prefill into it, prefill after a
# prefix, chunked prefill, a serving step's documents), where nearly every call has a (query, key)
# shape not seen before. The default choice for MLA's shapes on the H200 is cuDNN's SDPA, which
# builds an execution plan for each new shape: a fresh server's first packed step of 32 documents
# took seconds against 0.08 s warm, nearly all of it planning (docs/LOG.md). Masked calls therefore
# use the kernels that need no plan: on CUDA the memory-efficient one (flash takes no mask, nor
# d_qk != d_v), on CPU flash; so a cached prefill and the same prefill without a cache may differ by bf16 rounding. Unmasked calls
# (training) keep the default choice: a uniform batch repeats one shape, so its plans are reused (a
# packed row's documents do vary in length; what cuDNN's plans cost training there is not measured).
MASKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
        self._fused: FusedProjection | None = None  # `fuse_input_projections`

    # ------------------------------------------------------------------ projections
    def input_projections(self) -> tuple[str, ...]:
        """The Linear layers reading x, in their fused order (`fuse_input_projections`); q_b_proj and
        kv_b_proj read the normalized latents, o_proj the attention output: not x."""
        q = ("q_proj",) if self.config.q_lora_rank is None else ("q_a_proj",)
        return (*q, "kv_a_proj_with_mqa", *(("g_proj",) if self.config.mla_use_output_gate else ()))

    def fuse_input_projections(self) -> str:
        """Run the input projections as one GEMM in forwards without autograd (k3.model.fusion);
        returns what it did, one line. Parameter names, values and memory are unchanged."""
        return fuse_layer_inputs(self, "MLA")

    def queries(self, x: torch.Tensor, q_in: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, D] -> [B, T, H, N+R]. `q_in`: q_proj(x) or q_a_proj(x) when already computed (fused)."""
        if self.config.q_lora_rank is None:
            q = self.q_proj(x) if q_in is None else q_in
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x) if q_in is None else q_in))
        return q.view(*x.shape[:-1], self.num_heads, self.nope_dim + self.pe_dim)

    def latents(self, x: torch.Tensor, kv_in: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, D] -> [B, T, L+R]: the normalized latent c and the unrotated k_pe (what is cached).
        `kv_in`: kv_a_proj_with_mqa(x) when already computed (fused)."""
        c, k_pe = (self.kv_a_proj_with_mqa(x) if kv_in is None else kv_in).split([self.latent_dim, self.pe_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def rotate(self, q: torch.Tensor, lat: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With `mla_use_nope` off, q [B, T, H, N+R] and lat [B, T, L+R] with their R-wide pe slots
        rotated by `positions` [B, T] (each token's index in its document); else both unchanged."""
        if self.config.mla_use_nope or self.pe_dim == 0:
            return q, lat
        R = self.pe_dim
        inv_freq = self.config.rope_theta ** (-torch.arange(0, R, 2, device=q.device, dtype=torch.float32) / R)
        angle = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, R/2]
        angle = torch.cat([angle, angle], -1)  # rotate-half: both halves turn by the same angles
        cos, sin = angle.cos(), angle.sin()

        def turn(x, cos, sin):  # rotate-half RoPE in fp32
            xf = x.float()
            x1, x2 = xf.chunk(2, dim=-1)
            return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

        q = torch.cat([q[..., :self.nope_dim], turn(q[..., self.nope_dim:], cos[:, :, None], sin[:, :, None])], -1)
        lat = torch.cat([lat[..., :self.latent_dim], turn(lat[..., self.latent_dim:], cos, sin)], -1)
        return q, lat

    def _positions(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, state: MLAState | None) -> torch.Tensor:
        """[B, T]: each new token's index in its document (the cached ones before it counted)."""
        B, T = x.shape[:2]
        t = torch.arange(T, device=x.device)
        if cu_seqlens is None:
            return (t[None] if state is None else state.lengths[:, None] + t).expand(B, T)
        rows = torch.repeat_interleave(torch.arange(cu_seqlens.numel() - 1, device=x.device), cu_seqlens.diff(),
                                       output_size=T)
        pos = t - cu_seqlens[rows]
        return (pos if state is None else pos + state.lengths[rows])[None]

    # ------------------------------------------------------------------ attention
    def attend(self, q: torch.Tensor, lat: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, T, H, N+R] against the latents lat [B, S, L+R] -> [B, T, H*V]. mask: bool,
        broadcastable to [B, 1, T, S] (True = may attend); None = causal with S == T."""
        impl = self.config.mla_impl
        # batch-invariant arithmetic (k3.ops.batch_invariant) computes every query as a decode step does
        if impl == "absorb" or (impl == "auto" and (q.shape[1] == 1 or batch_invariant.enabled())):
            o = self._attend_absorbed(q, lat, mask)
        else:
            o = self._attend_naive(q, lat, mask)
        return o.flatten(2)

    def _attend_naive(self, q, lat, mask):
        B, S, H = lat.shape[0], lat.shape[1], self.num_heads
        c, k_pe = lat.split([self.latent_dim, self.pe_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(B, S, H, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, H, self.pe_dim)], dim=-1)
        with nullcontext() if mask is None else sdpa_kernel(MASKED_SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return o.transpose(1, 2)  # [B, T, H, V]

    def _attend_absorbed(self, q, lat, mask):
        H, L = self.num_heads, self.latent_dim
        w = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, L)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim:]  # [H, N, L], [H, V, L]
        q_nope, q_pe = q.split([self.nope_dim, self.pe_dim], dim=-1)
        # [q_nope W_uk | q_pe] . [c | k_pe] = q_nope.k_nope + q_pe.k_pe: one product reads each
        # cached row once (at decode this read is the step's cost).
        q_abs = torch.cat([torch.einsum("bthn,hnl->bthl", q_nope, w_uk), q_pe], dim=-1)
        scores = torch.einsum("bthw,bsw->bhts", q_abs, lat).float() * self.scale
        if mask is None:
            T = q.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(lat.dtype)
        o_lat = torch.einsum("bhts,bsl->bthl", p, lat[..., :L])
        return torch.einsum("bthl,hvl->bthv", o_lat, w_uv)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                state: MLAState | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. Packed rows (cu_seqlens, B == 1) never attend across documents;
        with `state`, sequence n attends to its cached latents and its new ones are appended (the
        buffer must have room: `K3Cache.reserve`, which the model's forward calls)."""
        fused, projs = active(self._fused), [None] * 3
        if fused is not None:  # one GEMM for every projection of x, split into views: q (or q_a), kv_a[, g]
            projs[:len(fused.sizes)] = fused(x).split(fused.sizes, dim=-1)
        q, lat = self.queries(x, projs[0]), self.latents(x, projs[1])
        if not self.config.mla_use_nope:
            q, lat = self.rotate(q, lat, self._positions(x, cu_seqlens, state))
        if state is None and cu_seqlens is None:
            o = self.attend(q, lat, mask=None)
        elif state is None and host_free.active():  # no per-document loop: that needs the bounds on the host
            o = self._attend_masked(q, lat, cu_seqlens, host_free.segment())
        elif state is None:
            o = x.new_empty(*x.shape[:2], self.num_heads * self.v_dim)
            for start, end in _bounds(cu_seqlens):
                o[:, start:end] = self.attend(q[:, start:end], lat[:, start:end], mask=None)
        else:
            num_seqs = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
            if state.buffer.shape[0] != num_seqs:
                raise ValueError(f"MLA layer {self.layer_idx}: the cache holds {state.buffer.shape[0]} sequences, "
                                 f"the batch has {num_seqs}")
            # Under autograd the buffer is replaced, not written, so tensors saved for backward by an
            # earlier forward stay intact; under no_grad (decode) it is written in place.
            buffer = state.buffer.clone() if torch.is_grad_enabled() else state.buffer
            if cu_seqlens is None:
                o = self._extend_uniform(q, lat, buffer, state.lengths)
            elif host_free.active():  # a captured serving step: no lengths on the host, fixed shapes
                o = self._extend_packed_host_free(q, lat, buffer, state.lengths, cu_seqlens,
                                                  host_free.chunk(), host_free.decode_rows())
            else:
                o = self._extend_packed(q, lat, buffer, state.lengths, cu_seqlens)
            state.buffer = buffer
        return self.output(o, x, projs[2])

    def _attend_masked(self, q, lat, cu_seqlens, segment: int | None) -> torch.Tensor:
        """A packed row [1, T] in one attention with a document mask built on the device; cut into
        [T / segment, segment] rows when no document crosses a multiple of `segment` (a row of
        whole training windows: segment^2 per window instead of T^2 per row)."""
        T = q.shape[1]
        seg = segment if segment is not None and T % segment == 0 else T
        o = self.attend(q.reshape(T // seg, seg, *q.shape[2:]), lat.reshape(T // seg, seg, lat.shape[-1]),
                        _document_mask(cu_seqlens, T, seg))
        return o.reshape(1, T, o.shape[-1])

    def output(self, o: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output o [B, T, H*V] -> [B, T, D]: the sigmoid output gate, then o_proj.
        `gate`: g_proj(x) when already computed (fused)."""
        if self.config.mla_use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x) if gate is None else gate)
        return self.o_proj(o)

    def _extend_uniform(self, q, lat, buffer, lengths):
        """B sequences continued by T tokens each, in one batched attention over the whole buffer
        (no host synchronization: a CUDA-graph decode step replays this)."""
        B, T = lat.shape[:2]
        pos = lengths[:, None] + torch.arange(T, device=lat.device)  # [B, T] absolute positions
        buffer[torch.arange(B, device=lat.device)[:, None], pos] = lat.to(buffer.dtype)
        mask = torch.arange(buffer.shape[1], device=lat.device) <= pos[:, :, None]  # [B, T, S]
        lengths += T
        return self.attend(q, buffer.to(lat.dtype), mask[:, None])

    def _extend_packed(self, q, lat, buffer, lengths, cu_seqlens):
        """One packed row of N documents: every latent written by one indexed store, then the
        one-token documents (a serving step's decode rows) attended as one [n, 1] batch over their
        own buffer rows, and each longer document alone. The lengths are read back to the host
        once, as packed prefill does anyway; a loop over every document would cost a dozen kernel
        launches per decode row in every MLA layer of a serving step."""
        past, new = lengths.tolist(), seq_lengths(cu_seqlens)
        T = q.shape[1]
        rows = torch.repeat_interleave(torch.arange(len(new), device=q.device), cu_seqlens.diff(), output_size=T)
        # each token's row in its document's cache: the document's past plus its offset in the chunk
        pos = lengths[rows] + torch.arange(T, device=q.device) - cu_seqlens[rows]
        buffer[rows, pos] = lat[0].to(buffer.dtype)
        o = q.new_empty(*q.shape[:2], self.num_heads * self.v_dim)
        single = [n for n, count in enumerate(new) if count == 1]
        starts = [0, *accumulate(new)]
        if single:
            S = max(past[n] for n in single) + 1
            at = torch.tensor([starts[n] for n in single], device=q.device)
            last = torch.tensor([past[n] for n in single], device=q.device)
            mask = torch.arange(S, device=q.device) <= last[:, None, None, None]  # [n, 1, 1, S]
            o[0, at] = self.attend(q[0, at, None], buffer[single, :S].to(lat.dtype), mask)[:, 0]
        for n in (n for n, count in enumerate(new) if count > 1):
            start, end, S = starts[n], starts[n + 1], past[n] + new[n]
            mask = torch.arange(S, device=q.device) <= torch.arange(past[n], S, device=q.device)[:, None]  # [T, S]
            o[:, start:end] = self.attend(q[:, start:end], buffer[n:n + 1, :S].to(lat.dtype), mask)
        lengths += cu_seqlens.diff().to(lengths)
        return o

    def _extend_packed_host_free(self, q, lat, buffer, lengths, cu_seqlens, chunk: int | None,
                                 decode_rows: int):
        """`_extend_packed` with no host read and shapes fixed by the tensors' and the hints' alone
        (k3.ops.host_free): document n continues cache row n, a zero-length one leaves it as it
        was. The first `decode_rows` documents (at most one token each) attend as one [d, 1] batch,
        the others as a padded [N - d, chunk] grid of queries (chunk None: T), every query against
        its whole buffer row with a mask by the device lengths. Pad tokens at the row's end must be
        a last document whose row is the caller's scratch: they are written and attended like any."""
        T, N, d = q.shape[1], buffer.shape[0], decode_rows
        if d > N:
            raise ValueError(f"MLA layer {self.layer_idx}: decode_rows={d} but the cache holds {N} sequences")
        chunk = T if chunk is None else chunk
        doc, offset = token_documents(cu_seqlens, T)
        past = lengths.clone()  # before this step: the mask's base
        buffer[doc, past[doc] + offset] = lat[0].to(buffer.dtype)
        keys = torch.arange(buffer.shape[1], device=q.device)
        starts = cu_seqlens[:-1].clamp(max=T - 1)  # a zero-length document's slots read any token, then are dropped
        outs = []
        if d:
            mask = keys <= past[:d, None, None, None]  # [d, 1, 1, S]
            outs.append(self.attend(q[0, starts[:d], None], buffer[:d].to(lat.dtype), mask).flatten(0, 1))
        if d < N:
            j = torch.arange(chunk, device=q.device)
            slots = (starts[d:, None] + j).clamp(max=T - 1)  # [N - d, chunk] token of each query slot
            mask = keys <= (past[d:, None] + j)[:, None, :, None]  # [N - d, 1, chunk, S]
            outs.append(self.attend(q[0, slots], buffer[d:].to(lat.dtype), mask).flatten(0, 1))
        # each token's output slot: its decode row's, else its grid cell's
        grid_slot = d + (doc - d) * chunk + offset
        o = torch.cat(outs).index_select(0, torch.where(doc < d, doc, grid_slot))
        lengths += cu_seqlens.diff().to(lengths)
        return o[None]


def _document_mask(cu_seqlens: torch.Tensor, tokens: int, segment: int) -> torch.Tensor:
    """[T / segment, 1, segment, segment] bool: within each segment of the row, query t may attend
    key s iff both lie in one document and s <= t."""
    doc, _ = token_documents(cu_seqlens, tokens)
    doc = doc.view(tokens // segment, segment)
    t = torch.arange(segment, device=cu_seqlens.device)
    return ((doc[:, :, None] == doc[:, None, :]) & (t[None, :] <= t[:, None]))[:, None]


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each document of a packed row."""
    b = cu_seqlens.tolist()
    return list(pairwise(b))
