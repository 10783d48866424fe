"""Gated-linear-unit FFNs: the SiTU-GLU activation and the two FFN modules (DESIGN §6).

N tokens (any leading dims), D input width, I intermediate width.

SiTU ("soft-capped" GLU, K3): g' = b1*tanh(g/b1)*sigmoid(g), u' = b2*tanh(u/b2), out = g'*u'.
Both factors are bounded (|g'| < b1, |u'| < b2), so |g'*u'| < b1*b2 = 100 whatever the input,
which is why K3 uses it for every FFN; near 0 tanh(x/b)*b ~ x, so it reduces to SwiGLU.
`hidden_act == "silu"` (Kimi-Linear) is the plain SwiGLU silu(g)*u. Both are computed in fp32
(the official code does SiTU in fp32) and cast back to the input dtype.

Parameter names are the official checkpoint's (DESIGN §6): `gate_proj/up_proj/down_proj` for the
dense layer-0 MLP and the shared experts; the routed experts (`w1 (gate) / w3 (up) / w2 (down)`)
are stacked in k3/model/experts.py.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from k3.config import K3Config

GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU g'*u' (DESIGN §6); bounded by beta1*beta2 in absolute value."""
    dtype = gate.dtype
    g, u = gate.float(), up.float()
    g = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)
    u = beta2 * torch.tanh(u / beta2)
    return (g * u).to(dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU silu(g)*u (Kimi-Linear, `hidden_act: silu`)."""
    dtype = gate.dtype
    return (F.silu(gate.float()) * up.float()).to(dtype)


def glu_activation(config: K3Config) -> GLU:
    """The GLU that `config.hidden_act` names, with the config's SiTU betas."""
    if config.hidden_act == "situ":
        return functools.partial(situ_glu, beta1=config.activation_situ_beta, beta2=config.activation_situ_linear_beta)
    if config.hidden_act == "silu":
        return silu_glu
    raise ValueError(f"hidden_act must be 'situ' or 'silu', got {config.hidden_act!r}")


def _init_linears(module: nn.Module, std: float) -> None:
    for p in module.parameters():
        nn.init.normal_(p, mean=0.0, std=std)


class DenseMLP(nn.Module):
    """down_proj(act(gate_proj x, up_proj x)): the dense layer-0 FFN (`mlp.*`) and the shared
    experts (`block_sparse_moe.shared_experts.*`, width moe_intermediate_size * num_shared_experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, config: K3Config):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = glu_activation(config)
        self.init_std = config.initializer_range
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linears(self, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
