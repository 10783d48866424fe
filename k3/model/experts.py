"""The routed-expert bank of a MoE layer: E SiTU/SiLU-GLU experts stored as stacked weights.

N tokens, k experts per token, E experts, H expert width (the latent width for Stable LatentMoE),
I expert intermediate width.

Weights are stacked — `w1`, `w3` [E, I, H] (gate, up) and `w2` [E, H, I] (down) — rather than E
separate modules: the official checkpoint's `experts.{e}.w1.weight` is exactly `w1[e]` (the
checkpoint code splits and stacks at the file boundary, k3/checkpoint/official.py), building the
2.78T model on the meta device takes 92 modules instead of 247k, and a GPU runs all experts in
one grouped GEMM (`torch._grouped_mm`) instead of a Python loop.

Where the grouped GEMM is not available (fp32, CPU, pre-sm90) the experts run in a per-expert loop
whose split sizes are read on the host; in host-free mode (k3/ops/host_free.py) they run instead
as one padded batched GEMM with fixed shapes (`_padded_bmm`), so a whole step can be captured.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from k3.config import K3Config
from k3.model.situ import glu_activation
from k3.ops import host_free


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

    def run_sorted(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple | None = None,
                   capacity: int | None = None) -> torch.Tensor:
        """x [M, H] sorted by expert, counts [E'] rows per expert -> [M, H]. `weights`: another
        stack of (w1, w3, w2) [E', ...] to run instead of the bank's own (expert parallelism runs
        a rank's home experts and copies of others, k3/parallel/expert_parallel.py). `capacity`:
        the most rows one expert can hold (the host-free path pads every expert to it; default M)."""
        w1, w3, w2 = self.weights() if weights is None else weights
        x = self.inputs(x)
        if grouped_mm_available(x):
            # _grouped_mm is not autocast-aware (pytorch#174763): match the activations' dtype
            w1, w3, w2 = (w.to(x.dtype) for w in (w1, w3, w2))
            offs = counts.cumsum(0).to(torch.int32)
            gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(self.act(gate, up), w2.transpose(-2, -1), offs=offs)
        if host_free.active():
            return self._padded_bmm(x, counts, x.shape[0] if capacity is None else capacity, w1, w3, w2)
        return self._loop_over_experts(x, counts, w1, w3, w2)

    def _padded_bmm(self, x: torch.Tensor, counts: torch.Tensor, capacity: int, w1: torch.Tensor,
                    w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """The per-expert loop with fixed shapes, for host-free mode: row r of expert e goes to
        slot (e, r) of a zero-padded [E, C, H] buffer, three torch.bmm over the stacked weights,
        and the rows come back by the same slots. Each row's products are the loop's, so the
        result equals it within fp32 rounding; padding rows are never read back.

        Memory: E*C*H for the buffer and its output, E*C*I for each of the three intermediates:
        with C = N (forward's capacity) E/k times the loop's activations. That is why only the
        host-free mode (the CUDA-graph step of small models, k3/train/graph_step.py) takes it."""
        E, (M, H) = counts.shape[0], x.shape
        ends = counts.cumsum(0)
        rows = torch.arange(M, device=x.device)
        expert = torch.searchsorted(ends, rows, right=True)  # expert of each sorted row, on device
        rank = rows - (ends - counts)[expert]
        # a device-side check, never a host read: an overfull expert would spill into the next one
        torch._assert_async((rank < capacity).all(), "routed experts: an expert got more rows than its capacity")
        slot = expert * capacity + rank
        buf = x.new_zeros(E * capacity, H).index_copy(0, slot, x).view(E, capacity, H)
        gate = torch.bmm(buf, w1.transpose(-2, -1))
        up = torch.bmm(buf, w3.transpose(-2, -1))
        out = torch.bmm(self.act(gate, up), w2.transpose(-2, -1))
        return out.view(E * capacity, -1).index_select(0, slot)

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
        (token, slot) order with one index_copy; the k slots are summed in fp32. A row of idx names
        k distinct experts (top-k), so no expert gets more than N rows: the host-free path's capacity."""
        n, k = idx.shape
        if n == 0:  # e.g. a step where this rank received no tokens
            return torch.zeros_like(x)
        flat_expert = idx.flatten()
        order = torch.argsort(flat_expert, stable=True)
        counts = expert_counts(flat_expert, self.num_experts)
        y = self.run_sorted(x.index_select(0, order // k), counts, capacity=n)
        y = y.float() * weights.flatten()[order, None]
        y = torch.zeros_like(y).index_copy(0, order, y)  # back to (token, slot) order
        return y.view(n, k, -1).sum(1).to(x.dtype)
