"""The routed-expert bank of a MoE layer: E SiTU/SiLU-GLU experts stored as stacked weights.

N tokens, k experts per token, E experts, H expert width (the latent width for Stable LatentMoE),
I expert intermediate width.

Weights are stacked — `w1`, `w3` [E, I, H] (gate, up) and `w2` [E, H, I] (down) — rather than E
separate modules: the official checkpoint's `experts.{e}.w1.weight` is exactly `w1[e]` (the
checkpoint code splits and stacks at the file boundary, k3/checkpoint/official.py), building the
2.78T model on the meta device takes 92 modules instead of 247k, and a GPU runs all experts in
one grouped GEMM (`torch._grouped_mm`) instead of a Python loop.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from k3.config import K3Config
from k3.model.situ import glu_activation


def grouped_mm_available(x: torch.Tensor) -> bool:
    # torch._grouped_mm: bf16 on sm90+ (the H200); everything else takes the per-expert loop
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def expert_counts(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows routed to each expert: idx [...] -> [num_experts] int64. A scatter-add rather than
    torch.bincount, whose CUDA kernel reads max(idx) back to the host: this one never synchronizes,
    so a decode step can be captured in a CUDA graph."""
    flat = idx.flatten()
    return torch.zeros(num_experts, dtype=torch.long, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


class RoutedExperts(nn.Module):
    def __init__(self, config: K3Config, hidden_size: int, intermediate_size: int):
        super().__init__()
        E = config.num_experts
        self.num_experts = E
        self.w1 = nn.Parameter(torch.empty(E, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(E, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(E, hidden_size, intermediate_size))
        self.act = glu_activation(config)
        self.init_std = config.initializer_range

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, mean=0.0, std=self.init_std)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) as the experts use them; quantization-aware training overrides this."""
        return self.w1, self.w3, self.w2

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The expert inputs as the experts see them; quantization-aware training overrides this."""
        return x

    def run_sorted(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        """x [M, H] sorted by expert, counts [E'] rows per expert -> [M, H]. `weights`: another
        stack of (w1, w3, w2) [E', ...] to run instead of the bank's own (expert parallelism runs
        a rank's home experts and copies of others, k3/parallel/expert_parallel.py)."""
        w1, w3, w2 = self.weights() if weights is None else weights
        x = self.inputs(x)
        if grouped_mm_available(x):
            # _grouped_mm is not autocast-aware (pytorch#174763): match the activations' dtype
            w1, w3, w2 = (w.to(x.dtype) for w in (w1, w3, w2))
            offs = counts.cumsum(0).to(torch.int32)
            gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(self.act(gate, up), w2.transpose(-2, -1), offs=offs)
        return self._loop_over_experts(x, counts, w1, w3, w2)

    # Runs eager inside compiled regions (k3.regional_compile): the split sizes are read on
    # the host, so a traced loop would be specialized, and recompiled, for every routing pattern.
    @torch.compiler.disable
    def _loop_over_experts(self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                           w2: torch.Tensor) -> torch.Tensor:
        # unbind, not w[e]: the backward of E selects is E zero-filled [E, ...] gradients summed
        # (O(E^2) bytes per bank), of one unbind a single stack
        outs = []
        for chunk, w1_e, w3_e, w2_e in zip(x.split(counts.tolist()), w1.unbind(0), w3.unbind(0), w2.unbind(0)):
            if chunk.shape[0]:
                outs.append(F.linear(self.act(F.linear(chunk, w1_e), F.linear(chunk, w3_e)), w2_e))
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{idx[:, j]}(x): x [N, H], weights/idx [N, k] -> [N, H].

        Sort-based dispatch: the N*k (token, slot) pairs are sorted by expert and gathered once,
        the experts run on contiguous slices (one grouped GEMM on GPU), and the results return to
        (token, slot) order with one index_copy; the k slots are summed in fp32."""
        n, k = idx.shape
        if n == 0:  # e.g. a step where this rank received no tokens
            return torch.zeros_like(x)
        flat_expert = idx.flatten()
        order = torch.argsort(flat_expert, stable=True)
        counts = expert_counts(flat_expert, self.num_experts)
        y = self.run_sorted(x.index_select(0, order // k), counts)
        y = y.float() * weights.flatten()[order, None]
        y = torch.zeros_like(y).index_copy(0, order, y)  # back to (token, slot) order
        return y.view(n, k, -1).sum(1).to(x.dtype)
