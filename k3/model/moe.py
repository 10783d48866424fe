"""Stable LatentMoE and its sigmoid top-k router (SPEC §6). Module name in a layer: `block_sparse_moe`.

N tokens (B*T flattened), D hidden width, L latent width (routed_expert_hidden_size), E experts,
k experts per token, I expert intermediate width.

    s   = sigmoid(gate(x))                              # router reads FULL-width x, fp32 (§12.2)
    idx = topk(s + e_score_correction_bias, k)          # the bias only selects
    p   = s[idx] / sum(s[idx]) * routed_scaling_factor  # renormalized when moe_renormalize
    z   = routed_expert_down_proj(x)                    # D -> L
    u   = routed_expert_norm(sum_j p_j E_j(z))          # RMSNorm(L); experts L -> I -> L
    y   = routed_expert_up_proj(u) + shared_experts(x)

Kimi-Linear (routed_expert_hidden_size absent) is the classic MoE: experts at width D and no
down/norm/up around them. The bias is a persistent buffer: the official checkpoint stores it
(`gate.e_score_correction_bias`, fp32, like transformers' KimiLinearTopkRouter), the optimizer
must not train it (balancing replaces it, k3/model/balance.py), and it stays frozen at inference.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from k3.config import K3Config
from k3.model.norm import RMSNorm
from k3.model.situ import DenseMLP, Expert


class MoEGate(nn.Module):
    """Sigmoid top-k router with an aux-loss-free selection bias (`noaux_tc`, DeepSeek-V3 style).

    In training mode it keeps (detached) what balancing needs from the last forward:
    `last_scores` [N, E] fp32 and `expert_load` [E] int64 (tokens routed to each expert).
    """

    def __init__(self, config: K3Config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.init_std = config.initializer_range
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.last_scores: torch.Tensor | None = None
        self.expert_load: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.e_score_correction_bias)

    def _apply(self, fn, recurse=True):
        # The router stays fp32 through a model-wide dtype cast (SPEC §6 routes in fp32; a bf16
        # bias would quantize the selection margins ~4e-3 apart), as transformers'
        # `_keep_in_fp32_modules_strict` does for these two tensors. Device moves still apply.
        super()._apply(fn, recurse)
        for t in (self.weight, self.e_score_correction_bias):
            if t.dtype != torch.float32 and t.is_floating_point():
                t.data = t.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert indices [N, k] int64)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight))
        idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * self.routed_scaling_factor
        if self.training:
            self.last_scores = scores.detach()
            self.expert_load = torch.bincount(idx.flatten(), minlength=self.num_experts)
        return weights, idx


def route_and_combine(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """sum_j weights[:, j] * experts[idx[:, j]](x): x [N, D], weights/idx [N, k] -> [N, D].

    Sort-based dispatch: the N*k (token, slot) pairs are sorted by expert, gathered once, and each
    active expert runs on its contiguous slice; the results go back to (token, slot) order with
    one index_copy (its backward is a gather) and the k slots are summed in fp32. One gather and
    one scatter in total, not one per expert: on CPU the per-expert scatters dominated the layer.
    This is the one place a grouped-GEMM / expert-parallel backend swaps in.
    """
    n, k = idx.shape
    if n == 0:  # e.g. a step where this rank received no tokens
        return torch.zeros_like(x)
    flat_expert = idx.flatten()
    order = torch.argsort(flat_expert, stable=True)
    counts = torch.bincount(flat_expert, minlength=len(experts)).tolist()
    chunks = x.index_select(0, order // k).split(counts)
    y = torch.cat([experts[e](chunk) for e, chunk in enumerate(chunks) if counts[e] > 0])
    y = y.float() * weights.flatten()[order, None]
    y = torch.zeros_like(y).index_copy(0, order, y)  # back to (token, slot) order
    return y.view(n, k, -1).sum(1).to(x.dtype)


class StableLatentMoE(nn.Module):
    """The `block_sparse_moe` FFN of layers >= first_k_dense_replace (SPEC §6)."""

    def __init__(self, config: K3Config):
        super().__init__()
        if config.num_experts < 1:
            raise ValueError(f"StableLatentMoE needs num_experts >= 1, got {config.num_experts}")
        self.hidden_size = config.hidden_size
        self.gate = MoEGate(config)
        width = config.moe_hidden_size
        self.experts = nn.ModuleList(Expert(width, config.moe_intermediate_size, config) for _ in range(config.num_experts))
        self.is_latent = config.routed_expert_hidden_size is not None
        if self.is_latent:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.routed_expert_norm = RMSNorm(width, config.rms_norm_eps) if config.latent_moe_use_norm else None
            self.routed_expert_up_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.shared_experts = (DenseMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts, config)
                               if config.num_shared_experts > 0 else None)
        self.init_std = config.initializer_range
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, initializer_range) for every matrix, zero selection bias, ones for the norm."""
        self.gate.reset_parameters()
        for expert in self.experts:
            expert.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        if self.is_latent:
            for proj in (self.routed_expert_down_proj, self.routed_expert_up_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=self.init_std)
            if self.routed_expert_norm is not None:
                self.routed_expert_norm.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] (or any [..., D]) -> y, same shape and dtype."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"StableLatentMoE expects last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, self.hidden_size)
        weights, idx = self.gate(flat)
        z = self.routed_expert_down_proj(flat) if self.is_latent else flat
        u = route_and_combine(z, weights, idx, self.experts)
        if self.is_latent:
            if self.routed_expert_norm is not None:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        if self.shared_experts is not None:
            u = u + self.shared_experts(flat)
        return u.reshape(x.shape)
