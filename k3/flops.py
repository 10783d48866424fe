"""The one training FLOP model: forward + backward FLOPs per token of a K3 model at sequence length T.

    6 * N_active                                  (N_active: k3/model/params.py, the embedding out,
                                                   lm_head and router in, unselected routed experts out)
  + per MLA layer: 3 * T * H * (d_qk + d_v)       (causal: each query sees T/2 keys on average,
                                                   2 FLOPs per multiply-add for QK^T and PV;
                                                   backward = 2x forward)
  + per KDA layer: 3 * H * (6 d^2 + 3 C d + C^2)  (the Kimi Linear paper's per-head forward per
                                                   token, C the chunk size; x3 forward + backward)

`k3 plan` (k3/parallel/sizing.py) times a step with it and the GPU benchmark (bench/gpu_bench.py)
computes MFU with it; docs/BENCHMARKS.md ("Method", "MFU") states the same formula.
"""
from __future__ import annotations

from k3.config import K3Config
from k3.model.params import count_parameters


def kda_flops_per_token(cfg: K3Config) -> float:
    """Forward + backward FLOPs per token of one KDA layer's recurrence (Kimi Linear paper, x3)."""
    d, C = cfg.kda_head_dim, cfg.kda_chunk_size
    return 3 * cfg.kda_num_heads * (6 * d * d + 3 * C * d + C * C)


def causal_attention_flops(T: int, H: int, d_qk: int, d_v: int) -> float:
    """Forward + backward FLOPs of causal softmax attention over one sequence of T tokens:
    forward 2 FLOPs x T^2/2 (query, key) pairs x H x (d_qk + d_v) for QK^T and PV; backward 2x."""
    return 3 * T * T * H * (d_qk + d_v)


def mla_flops_per_token(cfg: K3Config, T: int) -> float:
    """Per token of one MLA layer at length T: 3 T H (d_qk + d_v)."""
    return causal_attention_flops(T, cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim) / T


def train_flops_per_token(cfg: K3Config, T: int, active: int | None = None) -> dict:
    """{"active_params", "matmul_6N", "mla_attention", "kda_recurrence", "total"}: forward + backward
    FLOPs per token of the whole model at sequence length T. `active`: N_active when the caller
    already counted it (count_parameters builds the model on the meta device: seconds for K3)."""
    active = count_parameters(cfg)["active"] if active is None else active
    parts = {"matmul_6N": 6 * active, "mla_attention": cfg.num_mla_layers * mla_flops_per_token(cfg, T),
             "kda_recurrence": cfg.num_kda_layers * kda_flops_per_token(cfg)}
    return {"active_params": active, **parts, "total": sum(parts.values())}
