"""One decode step (one token for each of N sequences) captured as a CUDA graph and replayed.

A k3-1b decode step launches hundreds of small kernels; at batch 1 the host's launch time, not
the GPU, sets the pace. Replaying a captured graph launches them all at once. What makes the step
capturable: every decode-time write is in place (KDA states through `update_state_in_place`, MLA
rows into a buffer sized up front, `K3Cache.empty(capacity=...)`), and nothing in it reads a value
back to the host (expert counts by scatter-add, batched MLA attention masked by device lengths,
routed experts through torch._grouped_mm: bf16 on sm90+; the per-expert loop elsewhere reads its
counts on the host, so such models are refused).

Host bookkeeping is not replayed, so `step` does it: `cache.lengths` advances by one per replay.
The warm-up runs real steps and the capture advances the host lengths; the cache is restored to
what it held before each.
"""
from __future__ import annotations

import torch

from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.experts import RoutedExperts, grouped_mm_available


class CUDAGraphDecoder:
    def __init__(self, model: torch.nn.Module, cache: K3Cache, warmup_steps: int = 2, pool=None):
        """`pool`: the memory pool of another live decoder (its `pool`) that never replays at the
        same time as this one, so their intermediates share one allocation; None: a new pool."""
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"CUDAGraphDecoder needs a CUDA model, got device {device}")
        if model.training:  # training mode records router statistics on the host at every forward
            raise ValueError("CUDAGraphDecoder needs a model in eval mode")
        if not capturable_experts(model):
            raise ValueError("CUDAGraphDecoder: this model's routed experts run the per-expert loop, which reads "
                             "expert counts back to the host and cannot be captured; torch._grouped_mm (bf16 "
                             "weights on sm90+) can")
        self.model, self.cache = model, cache
        self.capacity = min((s.capacity for s in cache.layers if isinstance(s, MLAState)), default=None)
        self._check_room()
        self.tokens = torch.zeros(cache.num_seqs, 1, dtype=torch.long, device=device)
        saved = _snapshot(cache)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(side):  # compile / autotune kernels off the capture
            for _ in range(warmup_steps):
                model(self.tokens, cache=cache)
        torch.cuda.current_stream(device).wait_stream(side)
        _restore(cache, saved)  # the capture then sees the lengths the first replay will see
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(self.tokens, cache=cache)[:, -1]  # [N, V] fp32, rewritten by each replay
        _restore(cache, saved)
        self.pool = self.graph.pool()

    def _check_room(self) -> None:
        if self.capacity is not None and int(self.cache.lengths.max()) + 1 > self.capacity:
            raise RuntimeError(f"the cache's MLA buffers hold {self.capacity} tokens per sequence and are full; "
                               f"build it with K3Cache.empty(..., capacity=prompt + new tokens)")

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] (or [N, 1]) -> next-token logits [N, V]; the returned tensor is overwritten by
        the next step, so read (or copy) it first."""
        self._check_room()
        self.tokens.copy_(tokens.view(-1, 1))
        self.graph.replay()
        self.cache.lengths += 1
        return self.logits


def capturable_experts(model: torch.nn.Module) -> bool:
    """Whether every routed-expert bank would take the sync-free grouped GEMM on its device."""
    return all(grouped_mm_available(m.w1[:0]) for m in model.modules() if isinstance(m, RoutedExperts))


def _snapshot(cache: K3Cache) -> list:
    return [(s.conv.clone(), s.recurrent.clone()) if isinstance(s, KDAState) else s.lengths.clone()
            for s in cache.layers] + [cache.lengths.clone()]


def _restore(cache: K3Cache, saved: list) -> None:
    """Copy back in place: the graph holds these tensors' addresses. MLA rows written past the
    restored lengths are masked out and overwritten later."""
    for state, kept in zip(cache.layers, saved):
        if isinstance(state, KDAState):
            state.conv.copy_(kept[0])
            state.recurrent.copy_(kept[1])
        else:
            state.lengths.copy_(kept)
    cache.lengths.copy_(saved[-1])
