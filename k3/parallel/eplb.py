"""The static anchor: DeepSeek-V3's EPLB heuristic (replicate experts by recent load, pack them).

E experts, R ranks, P = E + redundant physical slots, P/R per rank. From a recent load [E]:
  1. replicate: each redundant slot goes to the expert with the highest load per copy;
  2. pack: copies, heaviest (load / copies) first, go to the least-loaded rank with a free slot
     that does not hold that expert yet.
The placement is then used for later batches, whose pairs split evenly over each expert's copies
(k3/parallel/ep_plan.plan_static); rank loads are balanced only as far as the recent load
predicts the current one. MoonEP's online plan (k3/parallel/ep_plan.plan_balanced) replaces the
prediction with the actual router output (DESIGN §14.2).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch


def eplb_replicas(recent_load: Sequence[float] | torch.Tensor, num_ranks: int, redundant: int) -> list[tuple[int, ...]]:
    """recent_load [E] -> for each expert the ranks holding a copy (E + redundant copies in all,
    (E + redundant) / R per rank)."""
    load = [float(x) for x in (recent_load.tolist() if isinstance(recent_load, torch.Tensor) else recent_load)]
    E, R = len(load), num_ranks
    slots = E + redundant
    if slots % R:
        raise ValueError(f"E + redundant = {slots} must divide over {R} ranks")
    per_rank = slots // R
    copies = [1] * E
    heap = [(-load[e], e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(redundant):
        _, e = heapq.heappop(heap)
        if copies[e] < R:  # at most one copy per rank
            copies[e] += 1
        heapq.heappush(heap, (-load[e] / copies[e] if copies[e] < R else float("inf"), e))
    spare = slots - sum(copies)  # experts that hit R copies leave slots unused; give them to the heaviest
    order = sorted(range(E), key=lambda e: -load[e] / copies[e])
    for e in order:
        while spare and copies[e] < R:
            copies[e] += 1
            spare -= 1
    physical = sorted(((load[e] / copies[e], e) for e in range(E) for _ in range(copies[e])), reverse=True)
    rank_load, rank_free = [0.0] * R, [per_rank] * R
    holders: list[list[int]] = [[] for _ in range(E)]
    for w, e in physical:
        r = min((r for r in range(R) if rank_free[r] and r not in holders[e]), key=lambda r: (rank_load[r], r))
        rank_load[r] += w
        rank_free[r] -= 1
        holders[e].append(r)
    return [tuple(h) for h in holders]
