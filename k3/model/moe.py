"""Stable LatentMoE and its sigmoid top-k router (DESIGN §6). Module name in a layer: `block_sparse_moe`.

N tokens (B*T flattened), D hidden width, L latent width (routed_expert_hidden_size), E experts,
k experts per token, I expert intermediate width.

    s   = sigmoid(gate(x))                              # router reads FULL-width x, fp32 (DESIGN §12.2)
    idx = topk(s + e_score_correction_bias, k)          # the bias only selects
    p   = s[idx] / sum(s[idx]) * routed_scaling_factor  # renormalized when moe_renormalize
    z   = routed_expert_down_proj(x)                    # D -> L
    u   = routed_expert_norm(sum_j p_j E_j(z))          # RMSNorm(L); experts L -> I -> L
    y   = routed_expert_up_proj(u) + shared_experts(x)

Kimi-Linear (routed_expert_hidden_size absent) is the classic MoE: experts at width D and no
down/norm/up around them. The bias is a persistent buffer: the official checkpoint stores it
(`gate.e_score_correction_bias`, fp32, like transformers' KimiLinearTopkRouter), the optimizer
must not train it (balancing replaces it, k3/train/balance.py), and it stays frozen at inference.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from k3.config import K3Config
from k3.model.experts import RoutedExperts, expert_counts
from k3.model.norm import RMSNorm
from k3.model.precision import KeepsFP32
from k3.model.situ import DenseMLP


class MoEGate(KeepsFP32):
    """Sigmoid top-k router with an aux-loss-free selection bias (`noaux_tc`, DeepSeek-V3 style).
    Both tensors stay fp32 through a model-wide dtype cast (k3/model/precision.py).

    In training mode it accumulates (detached) what balancing needs over every forward since the
    last `balance_step` — all micro-batches of one optimizer step, since QB balances the step's m
    tokens (DESIGN §6): `last_scores` [N, E] fp32, `last_indices` [N, k] (the experts picked) and
    `expert_load` [E] int64 (tokens per expert).
    """

    FP32_TENSORS = ("weight", "e_score_correction_bias")

    def __init__(self, config: K3Config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.init_std = config.initializer_range
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self._score_parts: list[torch.Tensor] = []  # one per training forward since clear_records
        self._index_parts: list[torch.Tensor] = []
        self.expert_load: torch.Tensor | None = None
        self.reset_parameters()

    @property
    def last_scores(self) -> torch.Tensor | None:
        """Router scores [N, E] of every training forward since the last `clear_records`."""
        if not self._score_parts:
            return None
        if len(self._score_parts) > 1:  # concatenated once, when read, not at every micro-batch
            self._score_parts = [torch.cat(self._score_parts)]
        return self._score_parts[0]

    @property
    def last_indices(self) -> torch.Tensor | None:
        """The experts each recorded token picked [N, k], in `last_scores`' order."""
        if not self._index_parts:
            return None
        if len(self._index_parts) > 1:
            self._index_parts = [torch.cat(self._index_parts)]
        return self._index_parts[0]

    def clear_records(self) -> None:
        self._score_parts, self._index_parts, self.expert_load = [], [], None

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert indices [N, k] int64)."""
        with torch.autocast(x.device.type, enabled=False):  # DESIGN §6: the router runs in fp32, autocast or not
            scores = torch.sigmoid(F.linear(x.float(), self.weight))
        idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * self.routed_scaling_factor
        if self.training:
            self._record(scores.detach(), idx)
        return weights, idx

    @torch.compiler.disable
    def _record(self, scores: torch.Tensor, idx: torch.Tensor) -> None:
        """Keep what balance_step needs. Runs eager inside a compiled MoE region: traced, the list
        append made dynamo guard on the list's length, so every micro-batch index compiled a new
        graph, and a loop without balance_step recompiled the MoE at every step until dynamo gave
        up and ran it eager."""
        load = expert_counts(idx, self.num_experts)
        self._score_parts.append(scores)
        self._index_parts.append(idx.reshape(-1, idx.shape[-1]))
        self.expert_load = load if self.expert_load is None else self.expert_load + load


class StableLatentMoE(nn.Module):
    """The `block_sparse_moe` FFN of layers >= first_k_dense_replace (DESIGN §6)."""

    def __init__(self, config: K3Config):
        super().__init__()
        if config.num_experts < 1:
            raise ValueError(f"StableLatentMoE needs num_experts >= 1, got {config.num_experts}")
        self.hidden_size = config.hidden_size
        self.gate = MoEGate(config)
        width = config.moe_hidden_size
        self.experts = RoutedExperts(config, width, config.moe_intermediate_size)
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
        self.experts.reset_parameters()
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
        u = self.experts(z, weights, idx)
        if self.is_latent:
            if self.routed_expert_norm is not None:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        if self.shared_experts is not None:
            u = u + self.shared_experts(flat)
        return u.reshape(x.shape)
