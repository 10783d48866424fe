"""Context parallelism: one long packed row split along time over a CP group (DESIGN §14.1).

R ranks, T tokens in the row (T = R*t, rank r holds tokens [r t, (r+1) t)), H heads, K head dim
(= V), W conv width, D hidden. Documents (`cu_seqlens` of the whole row) may cross rank
boundaries; every token-wise part of the model (embeddings, norms, FFN/MoE, AttnRes reads, the
loss) runs on the local tokens unchanged, and only the mixers see the other ranks:

KDA as KCP. A segment maps the state entering it affinely: S_out = M S_in + W, with M [K, K] per
head the product of the segment's transitions (I - b k k^T) Diag(a) and W [K, V] its writes from a
zero state (docs/SCALING.md derives it). Each rank computes its last document piece's pair (M, W)
locally (two op passes over that piece: from a zero state, and with v = 0 from S = I), one
fixed-size all-gather of the pairs ([R, 2, H, K, K] fp32, whatever T) gives every rank all of
them, a prefix scan over the ranks before it gives its exact incoming state, and it runs its
segment once from that state. A document that starts inside a segment enters with zero state, so
only the piece that continues across the boundary carries one. The short convs need the W-1
projected inputs before the segment: one more fixed-size all-gather ([R, 3 H K, W-1]).

MLA attends over all ranks' latents (the latent cache, L+R = 576 values per token for K3: small
next to the keys and values it stands for), all-gathered, with the causal and document mask of
the local queries' global positions.

Both all-gathers are autograd functions whose backward all-reduces the gradient and keeps this
rank's slice (gloo has no reduce-scatter), so forward and backward are exact. No exchange grows
with the sequence except MLA's latents, which full attention needs anyway.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3.model.cache import KDAState
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA


class _AllGather(torch.autograd.Function):
    """x [...] -> [R, ...] (every rank's x in rank order); backward sums the gradients of all ranks
    and returns this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    return _AllGather.apply(x, group)


@dataclass
class Segment:
    """This rank's share of one packed row, from the row's global cu_seqlens."""
    rank: int
    world: int
    start: int  # global position of the first local token
    length: int  # t
    cu_seqlens: torch.Tensor  # [N+1] local pieces (documents cut at the segment's edges)
    doc_start: torch.Tensor  # [t] global start of each local token's document
    starts_inside: list[bool]  # per rank: does that rank's segment start a document (no incoming state)
    single_piece: list[bool]  # per rank: is that rank's segment one piece (its state leaves through it)

    @property
    def continues(self) -> bool:
        return not self.starts_inside[self.rank]


def split_row(cu_seqlens: torch.Tensor, total: int, rank: int, world: int) -> Segment:
    """The segment of `rank` in a row of `total` tokens packed by `cu_seqlens` [N+1]."""
    if total % world:
        raise ValueError(f"context parallelism needs the row's {total} tokens to divide over {world} ranks")
    t = total // world
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to {total}, got {bounds[0]}..{bounds[-1]}")
    inner = set(bounds)
    starts_inside = [r * t in inner for r in range(world)]
    single_piece = [not any(r * t < b < (r + 1) * t for b in bounds) for r in range(world)]
    lo, hi = rank * t, (rank + 1) * t
    local = [0] + [b - lo for b in bounds if lo < b < hi] + [t]
    starts = torch.tensor(bounds[:-1])
    pos = torch.arange(lo, hi)
    doc_start = starts[torch.searchsorted(starts, pos, right=True) - 1]
    return Segment(rank, world, lo, t, torch.tensor(local, dtype=cu_seqlens.dtype, device=cu_seqlens.device),
                   doc_start.to(cu_seqlens.device), starts_inside, single_piece)


class ContextParallel:
    """Applies CP to a model's mixers from outside (the modules and their parameter names stay).

        cp = ContextParallel(group)
        cp.apply(model)
        ids_local, cu_local = cp.shard(ids, cu_seqlens)   # before every forward
        logits_local = model(ids_local, cu_seqlens=cu_local)
    """

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.segment: Segment | None = None

    def shard(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
        """input_ids [1, T] (one packed row; cu_seqlens None = one document) -> this rank's
        [1, T/R] and its local cu_seqlens; remembers the row's layout for the mixers."""
        T = input_ids.shape[1]
        if input_ids.shape[0] != 1:
            raise ValueError("context parallelism takes one packed row [1, T]")
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, T], device=input_ids.device)
        self.segment = split_row(cu_seqlens, T, self.rank, self.world)
        s = self.segment
        return input_ids[:, s.start:s.start + s.length], s.cu_seqlens

    def apply(self, model: nn.Module) -> nn.Module:
        for module in model.modules():
            if isinstance(module, KimiDeltaAttention):
                module.forward = types.MethodType(_kcp_forward(self), module)
            elif isinstance(module, GatedMLA):
                module.forward = types.MethodType(_mla_cp_forward(self), module)
        return model

    def _segment(self) -> Segment:
        if self.segment is None:
            raise RuntimeError("call ContextParallel.shard(input_ids, cu_seqlens) before the forward")
        return self.segment


def _kcp_forward(cp: ContextParallel):
    def forward(layer: KimiDeltaAttention, x: torch.Tensor, *, cu_seqlens=None, state=None) -> torch.Tensor:
        if state is not None:
            raise ValueError("context parallelism is for training and prefill rows, not cached decoding")
        seg = cp._segment()
        H, K, W = layer.num_heads, layer.head_dim, layer.conv_width
        t, N = x.shape[1], seg.cu_seqlens.numel() - 1
        if t < W - 1:
            raise ValueError(f"a CP segment needs >= {W - 1} tokens, got {t}")
        # conv tails: the W-1 projected inputs before each segment (zeros before a document's start)
        last = x[:, t - (W - 1):]
        tails = torch.cat([layer.q_proj(last), layer.k_proj(last), layer.v_proj(last)], dim=-1)[0].t()  # [3C, W-1]
        tails = tails * (seg.doc_start[-(W - 1):] == seg.doc_start[-1]).to(tails.dtype)  # this rank's last doc only
        # Every rank uses every gathered tensor (times 0 where it needs none), so every rank runs
        # the gathers' backward all-reduces, in the same order (the layers' order, reversed).
        gathered = all_gather(tails, cp.group)
        prev = gathered[max(seg.rank - 1, 0)] * float(seg.rank > 0 and seg.continues)
        conv0 = torch.cat([prev[None], tails.new_zeros(N - 1, *tails.shape)])  # later pieces start documents
        recurrent0 = torch.zeros(N, H, K, K, device=x.device)
        (q, k, v, g, beta), _ = layer.op_inputs(x, seg.cu_seqlens, KDAState(conv0, recurrent0))
        # this rank's (M, W): the affine map its last piece applies to the state entering it
        s0 = int(seg.cu_seqlens[-2])
        piece = [a[:, s0:] for a in (q, k, v, g, beta)]
        _, write = layer.op(*piece, output_final_state=True)  # [1, H, K, V] from a zero state
        if seg.single_piece[seg.rank] and seg.continues:
            eye = torch.eye(K, device=x.device).expand(1, H, K, K)
            _, trans = layer.op(piece[0], piece[1], torch.zeros_like(piece[2]), piece[3], piece[4],
                                initial_state=eye, output_final_state=True)
        else:
            trans = torch.zeros_like(write)
        pairs = all_gather(torch.stack([trans[0], write[0]]), cp.group)  # [R, 2, H, K, K]: fixed size
        incoming = pairs[0, 1] * 0.0
        for j in range(seg.rank):  # prefix scan: the state leaving rank j enters rank j+1 unless a document starts there
            leaving = pairs[j, 0] @ incoming + pairs[j, 1]
            incoming = leaving * float(not seg.starts_inside[j + 1])
        initial = torch.cat([incoming[None], recurrent0[1:]])
        o, _ = layer.op(q, k, v, g, beta, initial_state=initial, cu_seqlens=seg.cu_seqlens)
        return layer.op_output(o, x)

    return forward


def _mla_cp_forward(cp: ContextParallel):
    def forward(layer: GatedMLA, x: torch.Tensor, *, cu_seqlens=None, state=None) -> torch.Tensor:
        if state is not None:
            raise ValueError("context parallelism is for training and prefill rows, not cached decoding")
        seg = cp._segment()
        pos = torch.arange(seg.start, seg.start + seg.length, device=x.device)
        q, lat = layer.rotate(layer.queries(x), layer.latents(x), (pos - seg.doc_start)[None])  # RoPE ablation only
        full = all_gather(lat[0], cp.group).flatten(0, 1)[None]  # [1, T, L+R]: every rank's latents
        T = full.shape[1]
        keys = torch.arange(T, device=x.device)
        # causal, and only within the query's document
        mask = (keys[None, :] <= pos[:, None]) & (keys[None, :] >= seg.doc_start[:, None])  # [t, T]
        o = layer.attend(q, full, mask[None, None])
        return layer.output(o, x)

    return forward
