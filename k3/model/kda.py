"""Kimi Delta Attention layer (DESIGN §3): the linear-attention mixer of the KDA layers.

B batch, T tokens, D hidden, H heads, K head dim (= value dim), C = H*K, W conv width,
N sequences (B, or len(cu_seqlens) - 1 when packed).

Parameter names and shapes are the official checkpoint's (DESIGN §3). Checked against
transformers 5.24 `models/kimi_linear/modeling_kimi_linear.py` (KimiLinearDeltaAttention,
KimiLinearForgetGate, KimiLinearRMSNormGated), vLLM `model_executor/layers/kda.py` (Kimi Linear)
and vLLM `models/kimi_k3/nvidia/kda.py` (K3); they agree with DESIGN §3 on:
- q/k/v = SiLU(depthwise causal conv(proj x)), q/k L2-normalized over the head dim with eps 1e-6
  (fla's `l2norm`: x / sqrt(sum x^2 + eps)), scale K^-1/2, beta = sigmoid(b_proj x);
- forget gate z = f_b(f_a(x)) + dt_bias in fp32; Kimi Linear g = -exp(A_log) * softplus(z);
  K3 (gate_lower_bound lb) g = lb * sigmoid(exp(A_log) * z) (same form as fla's `lower_bound`
  option and transformers' Glm5NextTextForgetGate);
- output: o_proj(RMSNorm_head(o) * weight * sigmoid(gate)) in fp32, norm eps = rms_norm_eps,
  gate = g_proj(x) (K3, `use_full_rank_gate`) or g_b(g_a(x)) (Kimi Linear).
The checkpoints keep three convs (q_conv1d, k_conv1d, v_conv1d); transformers fuses them into one
`conv1d` at load time. We keep the official names and run them as three convs, except for a decode
step (one token per sequence), which runs one conv over the concatenated streams (`short_convs`).
"""
from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import KDAInputs, KDAState
from k3.model.fusion import FusedProjection, active, fuse_layer_inputs
from k3.model.norm import RMSNorm
from k3.model.precision import KeepsFP32
from k3.ops.conv import causal_conv1d
from k3.ops.kda import DecayGate, kda
from k3.ops.kda.replay import replay_tails
from k3.ops.norm_gate import rms_norm_gated


def a_log_shape(config: K3Config) -> tuple[int, ...]:
    """A_log in the official checkpoint shape of each family.
    Kimi Linear stores [1, 1, H, 1] (transformers KimiLinearForgetGate, vLLM layers/kda.py);
    K3 stores [H] (vLLM kimi_k3 `a_log_weight_loader`: "current 1D", 4-D is the old layout;
    DESIGN §12.3). The lower-bounded gate is what tells the families apart in the config."""
    H = config.kda_num_heads
    return (H,) if config.gate_lower_bound is not None else (1, 1, H, 1)


class KimiDeltaAttention(KeepsFP32):
    FP32_TENSORS = ("A_log", "dt_bias")  # decay parameters stay fp32 under .to(bf16)

    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, H, K, W = config.hidden_size, config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        self.num_heads, self.head_dim, self.conv_width = H, K, W
        C = H * K
        self.q_proj = nn.Linear(D, C, bias=False)
        self.k_proj = nn.Linear(D, C, bias=False)
        self.v_proj = nn.Linear(D, C, bias=False)
        # Depthwise short convs, nn.Conv1d only as the holder of the official [C, 1, W] weight:
        # the op (k3.ops.conv) runs them causally with carried tails.
        self.q_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)
        self.k_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)
        self.v_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, C, bias=False)
        self.A_log = nn.Parameter(torch.empty(a_log_shape(config), dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(C, dtype=torch.float32))
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(D, C, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, C, bias=False)
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps)  # its weight and eps; k3.ops.norm_gate applies it
        self.o_proj = nn.Linear(C, D, bias=False)
        # The short conv and the output norm-gate follow the KDA op's choice: fla's kernels together,
        # or the torch paths together (a forced torch KDA path is a reference run; so are they).
        self._kernel_impl = {"auto": "auto", "fla": "fla"}.get(config.kda_impl, "torch")
        self._fused: FusedProjection | None = None  # `fuse_input_projections`
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            # transformers' PreTrainedModel._init_weights draws Linear and Conv1d weights alike.
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        self.o_norm.reset_parameters()
        # A_log: 0 (decay rate 1) under the lower-bounded gate, log U(1, 16) under softplus — as
        # fla / transformers Glm5Next and KimiLinear `_init_weights` do (DESIGN §12.3).
        if self.config.gate_lower_bound is not None:
            nn.init.zeros_(self.A_log)
        else:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        # dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (Mamba/fla initialization).
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def input_projections(self) -> tuple[str, ...]:
        """The Linear layers reading x, in their fused order (`fuse_input_projections`)."""
        gate = ("g_proj",) if self.config.use_full_rank_gate else ("g_a_proj",)
        return ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", *gate)

    def fuse_input_projections(self) -> str:
        """Run the input projections as one GEMM in forwards without autograd (k3.model.fusion);
        returns what it did, one line. Parameter names, values and memory are unchanged."""
        return fuse_layer_inputs(self, "KDA")

    def forget_gate(self, x: torch.Tensor, f_a: torch.Tensor | None = None) -> tuple[torch.Tensor, DecayGate]:
        """x [B, T, D] -> the gate's raw projections [B, T, H, K] and its parameters; the KDA op
        activates them (`k3.ops.kda.gate`: in fla's kernels on CUDA, in fp32 torch elsewhere).
        `f_a`: f_a_proj(x) when already computed (the fused projections)."""
        raw = self.f_b_proj(self.f_a_proj(x) if f_a is None else f_a).unflatten(-1, (self.num_heads, self.head_dim))
        return raw, DecayGate(self.A_log, self.dt_bias, self.config.gate_lower_bound)

    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                state: KDAState | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. With `state`, continue its N sequences and leave the new conv
        tails and recurrent state in it."""
        B = x.shape[0]
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if state is not None:
            self._check_state(state, N)
        fused = active(self._fused)
        projs = None if fused is None else self._split_fused(fused(x))  # every projection of x in one GEMM
        (q, k, v, g_raw, beta), tails = self.op_inputs(x, cu_seqlens, state, projs)
        # Under no_grad (decode) the state is updated in place: it keeps its address for CUDA-graph
        # replay; under autograd it is replaced, keeping the graph through it intact.
        in_place = state is not None and not torch.is_grad_enabled()
        o, final_state = self.op(q, k, v, g_raw, beta, initial_state=None if state is None else state.recurrent,
                                 output_final_state=state is not None, cu_seqlens=cu_seqlens,
                                 update_state_in_place=in_place)
        if in_place:
            state.conv.copy_(tails)
        elif state is not None:
            state.conv = tails.to(state.conv.dtype)
            state.recurrent = final_state
        return self.op_output(o, x, None if projs is None else projs[3])

    def _split_fused(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused product [B, T, 3C+H+K+G] -> views (q|k|v [B, T, 3C], b, f_a) and the output gate [B, T, C]."""
        C, H, K = self.num_heads * self.head_dim, self.num_heads, self.head_dim
        qkv, b, f_a, g = y.split((3 * C, H, K, y.shape[-1] - 3 * C - H - K), dim=-1)
        return qkv, b, f_a, g if self.config.use_full_rank_gate else self.g_b_proj(g)

    # The three steps of forward, public so that context parallelism (k3/parallel) can run the op
    # on a segment with an initial state it computed, without a second copy of the layer's math.
    def op_inputs(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, state: KDAState | None,
                  projs: tuple[torch.Tensor, ...] | None = None):
        """x [B, T, D] -> ((q, k, v, g_raw, beta) as the KDA op takes them, new conv tails or None).
        `projs`: the fused projections of x (`_split_fused`), else each Linear runs here."""
        qkv, b, f_a = (None, None, None) if projs is None else projs[:3]
        (q, k, v), tails = self.short_convs(x, cu_seqlens, state, qkv)
        beta = torch.sigmoid((self.b_proj(x) if b is None else b).float())
        g_raw, _ = self.forget_gate(x, f_a)
        if state is not None and state.record is not None:  # kept for a replay (DESIGN §11)
            record = state.record
            record.k, record.v, record.g_raw, record.beta = k, v, g_raw, beta
        return (q, k, v, g_raw, beta), tails

    def op(self, q, k, v, g_raw, beta, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The KDA op with this layer's scale, gate and backend: (o [B, T, H, V], final state | None)."""
        return kda(q, k, v, g_raw, beta, scale=self.head_dim ** -0.5, impl=self.config.kda_impl,
                   chunk_size=self.config.kda_chunk_size, normalize_qk=True,
                   gate=DecayGate(self.A_log, self.dt_bias, self.config.gate_lower_bound), **kwargs)

    def op_output(self, o: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """The op's o [B, T, H, V] -> the layer's output [B, T, D]. `gate`: the output gate's
        projection of x [B, T, C] when already computed (the fused projections)."""
        if gate is None:
            gate = self.g_proj(x) if self.config.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        # Official order: normalize, multiply the norm weight, then the sigmoid gate, all in fp32.
        o = rms_norm_gated(o, gate.unflatten(-1, (self.num_heads, self.head_dim)), self.o_norm.weight,
                           eps=self.o_norm.eps, impl=self._kernel_impl)
        return self.o_proj(o.flatten(-2).to(x.dtype))

    def replay(self, inputs: KDAInputs, state: KDAState, cu_seqlens: torch.Tensor) -> KDAState:
        """The state after the tokens of `inputs` (packed [1, T, ...] by cu_seqlens, N sequences),
        advanced from `state` (before them) without running the layer again: the conv tails from
        the kept conv inputs, the recurrence by the KDA op on the kept k, v, gate and beta
        (`k3.ops.kda.replay`). Speculative decoding's rollback replays the accepted tokens."""
        self._check_state(state, cu_seqlens.numel() - 1)
        _, recurrent = kda(inputs.k, inputs.k, inputs.v, inputs.g_raw, inputs.beta, scale=self.head_dim ** -0.5,
                           initial_state=state.recurrent, output_final_state=True, cu_seqlens=cu_seqlens,
                           impl=self.config.kda_impl, chunk_size=self.config.kda_chunk_size, normalize_qk=True,
                           gate=DecayGate(self.A_log, self.dt_bias, self.config.gate_lower_bound), sequential=True)
        return KDAState(replay_tails(state.conv, inputs.conv_inputs, cu_seqlens), recurrent)

    def short_convs(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, state: KDAState | None,
                    qkv: torch.Tensor | None = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """q, k, v [B, T, H, K] = SiLU(causal conv(proj x)), and the new conv tails [N, 3C, W-1]
        when there is a state. Three convs, from which fla's conv returns each stream contiguous:
        fla's KDA kernels copy strided inputs, and one conv over the concatenated streams spent some
        6% of a 64K-token fwd+bwd on copies and concatenations. A decode step (one token per
        sequence) runs one conv instead: its cost is kernel launches, not bytes, and the single conv
        reads and writes the state's tails in one piece. `qkv`: the three projections of x side by
        side [B, T, 3C] (a view of the fused GEMM's product; fla's conv reads such strided views)."""
        T = x.shape[1]
        H, K = self.num_heads, self.head_dim
        projs, convs = (self.q_proj, self.k_proj, self.v_proj), (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        conv = partial(causal_conv1d, cu_seqlens=cu_seqlens, output_final_state=state is not None,
                       activation="silu", impl=self._kernel_impl)
        record = None if state is None else state.record
        if state is not None and T == 1 and cu_seqlens is None:
            weight = torch.cat([c.weight for c in convs]).squeeze(1)
            qkv_in = torch.cat([p(x) for p in projs], dim=-1) if qkv is None else qkv
            if record is not None:
                record.conv_inputs = qkv_in
            qkv, tails = conv(qkv_in, weight, initial_state=state.conv)
            return qkv.unflatten(-1, (3, H, K)).unbind(dim=2), tails
        initial = (None,) * 3 if state is None else state.conv.chunk(3, dim=1)
        # the projections first, then the convs: under torch.compile, fla's ops may each break the
        # graph, and breaks next to one another leave fewer, larger graphs
        inputs = [p(x) for p in projs] if qkv is None else list(qkv.chunk(3, dim=-1))
        if record is not None:
            record.conv_inputs = torch.cat(inputs, dim=-1) if qkv is None else qkv
        outs = [conv(y, c.weight.squeeze(1), initial_state=s) for y, c, s in zip(inputs, convs, initial, strict=True)]
        tails = None if state is None else torch.cat([t for _, t in outs], dim=1)
        return tuple(y.unflatten(-1, (H, K)) for y, _ in outs), tails

    def _check_state(self, state: KDAState, num_seqs: int) -> None:
        H, K, W = self.num_heads, self.head_dim, self.conv_width
        want_conv, want_rec = (num_seqs, 3 * H * K, W - 1), (num_seqs, H, K, K)
        if tuple(state.conv.shape) != want_conv:
            raise ValueError(f"KDA layer {self.layer_idx}: state.conv must be {list(want_conv)} "
                             f"(N, 3*H*K, W-1), got {list(state.conv.shape)}")
        if tuple(state.recurrent.shape) != want_rec:
            raise ValueError(f"KDA layer {self.layer_idx}: state.recurrent must be {list(want_rec)} "
                             f"(N, H, K, V), got {list(state.recurrent.shape)}")
