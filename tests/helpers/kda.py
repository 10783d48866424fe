"""Random KDA inputs (the op's and the layer's)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from k3.config import load_config
from k3.model.cache import KDAState
from k3.model.kda import KimiDeltaAttention
from k3.ops.kda import DecayGate

H, K, D = 2, 16, 32  # the layer tests' heads, head dim and hidden size


def make_inputs(B, T, H, K, V, gate, with_state=True, N=None):
    """Random KDA inputs shaped like the layer's: unit-norm q/k, sigmoid beta, gate from either form."""
    q = F.normalize(torch.randn(B, T, H, K), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    z = torch.randn(B, T, H, K)
    if gate == "lb":  # K3: lb * sigmoid(exp(A_log) * z), lb = -5
        g = -5.0 * torch.sigmoid(torch.randn(H, 1).exp() * z)
    else:  # Kimi Linear: -exp(A_log) * softplus(z), A_log = log U(1, 16)
        g = -torch.empty(H, 1).uniform_(1, 16) * F.softplus(z)
    beta = torch.sigmoid(torch.randn(B, T, H))
    h0 = torch.randn(N or B, H, K, V) if with_state else None
    return q, k, v, g, beta, h0


def make_gate(B, T, H, K, form):
    """Raw gate projections and gate parameters of either form (`k3.ops.kda.gate`), the decay
    parameters at their official init (DESIGN §12.3) for softplus, unit-scale for the bounded form."""
    raw = torch.randn(B, T, H, K)
    if form == "lb":
        return raw, DecayGate(torch.empty(H).uniform_(-1, 1), torch.empty(H * K).uniform_(-1, 1), -5.0)
    dt = torch.empty(H * K).uniform_(math.log(1e-3), math.log(1e-1)).exp()
    return raw, DecayGate(torch.empty(H).uniform_(1, 16).log(), dt + torch.log(-torch.expm1(-dt)), None)


def make_config(gate: str, **changes):
    """'lb': K3 (lower-bounded gate, full-rank output gate); 'softplus': Kimi Linear."""
    family = {"gate_lower_bound": -5.0, "use_full_rank_gate": True} if gate == "lb" else \
        {"gate_lower_bound": None, "use_full_rank_gate": False}
    return load_config("k3-tiny").replace(hidden_size=D, kda_num_heads=H, kda_head_dim=K, **family, **changes)


def make_layer(gate: str, **changes) -> KimiDeltaAttention:
    """A layer with every tensor randomized (init leaves outputs tiny and norms at one)."""
    layer = KimiDeltaAttention(make_config(gate, **changes), layer_idx=0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name in ("A_log", "dt_bias"):
                p.uniform_(-1, 1)
            elif name == "o_norm.weight":
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3)
    return layer


def random_state(config, n):
    state = KDAState.empty(config, n)
    state.conv.normal_()
    state.recurrent.normal_(0, 0.5)
    return state


def clone_state(state):
    return KDAState(state.conv.clone(), state.recurrent.clone())
