"""Perfectly balanced expert placement, planned online from the router's output (MoonEP, DESIGN §14.2).

E experts, R ranks, S tokens per rank, K experts per token, T = S*K token-expert pairs per rank.
Every expert has a home rank holding its weights (contiguous blocks, sizes differ by at most one,
m = ceil(E/R) at most); a rank may also host up to m redundant copies ("guests") of other ranks'
experts for one micro-batch and layer. A plan says how many of expert e's pairs run on each rank
(`tokens[e, r]`) so that every rank runs exactly T pairs: equal compute per rank, and dispatch
buffers of a static [T, H] shape.

The chain construction (why m guests always suffice). Let L_r be rank r's home load and
X_r = L_r - T its excess (heavy: X_r > 0; light: deficit D_r = -X_r >= 0). A carry of pieces
(expert, count), total C, moves from rank to rank:
  - a heavy rank is taken only while C <= T: it keeps every carried piece as a guest and forwards
    its own experts, largest first, C + X_r of them (at most m pieces, C + X_r <= L_r since C <= T);
    it keeps (T - C) of its own at home;
  - otherwise a light rank is taken: if C > T any light rank fits (D_r <= T < C); if no heavy rank
    is left, C is the sum of the remaining deficits, so again any fits; it keeps its own experts
    and takes D_r from the carry (guests: at most the carry's piece count) and forwards the rest.
The carry always holds at most m pieces (a heavy rank replaces it by <= m of its own, a light rank
only removes from it), so every rank hosts at most m guests, and it ends empty with every rank at
exactly T. The bound is tight up to rounding: all pairs on one expert need R - 1 copies of it.

`plan_balanced` is a pure function of the loads (ints on the host; E = 896 plans in ~1 ms), so
every rank computes the same plan from the all-gathered counts with no further agreement. No
torch.distributed here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def home_ranks(num_experts: int, num_ranks: int) -> list[int]:
    """Home rank of each expert: contiguous blocks whose sizes differ by at most one."""
    if num_ranks < 1 or num_experts < 1:
        raise ValueError(f"need >= 1 expert and rank, got E={num_experts}, R={num_ranks}")
    return [e * num_ranks // num_experts for e in range(num_experts)] if num_experts >= num_ranks else \
        list(range(num_experts))


@dataclass(frozen=True)
class Placement:
    """Where each expert's token-expert pairs run for one micro-batch and layer.

    tokens [E, R] int64: pairs of expert e that run on rank r (home or guest copy);
    home [E]: each expert's home rank; guests[r]: the experts rank r hosts as copies, sorted."""
    tokens: torch.Tensor
    home: tuple[int, ...]
    guests: tuple[tuple[int, ...], ...]

    @property
    def num_ranks(self) -> int:
        return self.tokens.shape[1]

    def rank_load(self) -> torch.Tensor:
        """[R] pairs each rank runs."""
        return self.tokens.sum(0)

    def max_guests(self) -> int:
        return max((len(g) for g in self.guests), default=0)


def _placement(pieces: dict[tuple[int, int], int], home: list[int], R: int) -> Placement:
    E = len(home)
    tokens = torch.zeros(E, R, dtype=torch.long)
    guests: list[set[int]] = [set() for _ in range(R)]
    for (e, r), n in pieces.items():
        if n:
            tokens[e, r] += n
            if r != home[e]:
                guests[r].add(e)
    return Placement(tokens, tuple(home), tuple(tuple(sorted(g)) for g in guests))


def plan_balanced(load: Sequence[int] | torch.Tensor, num_ranks: int) -> Placement:
    """The chain construction of the module docstring: load [E] pairs per expert over all ranks
    (their sum must be R*T) -> a Placement with exactly T pairs per rank and <= ceil(E/R) guests."""
    load = [int(x) for x in (load.tolist() if isinstance(load, torch.Tensor) else load)]
    R, E = num_ranks, len(load)
    total = sum(load)
    if total % R:
        raise ValueError(f"total pairs {total} must split evenly over {R} ranks (S*K per rank)")
    if min(load, default=0) < 0:
        raise ValueError("loads must be >= 0")
    T = total // R
    home = home_ranks(E, R)
    own: list[list[int]] = [[] for _ in range(R)]
    for e, r in enumerate(home):
        own[r].append(e)
    for r in range(R):
        own[r].sort(key=lambda e: -load[e])  # largest first: few, large forwarded pieces
    excess = [sum(load[e] for e in own[r]) - T for r in range(R)]
    heavy = sorted((r for r in range(R) if excess[r] > 0), key=lambda r: -excess[r])
    light = sorted((r for r in range(R) if excess[r] <= 0), key=lambda r: excess[r])  # largest deficit first
    pieces: dict[tuple[int, int], int] = {}

    def put(e: int, r: int, n: int) -> None:
        pieces[(e, r)] = pieces.get((e, r), 0) + n

    carry: list[list[int]] = []  # [expert, count], largest first
    carried = 0
    hi = li = 0
    while hi < len(heavy) or li < len(light):
        if hi < len(heavy) and carried <= T:
            r = heavy[hi]
            hi += 1
            for e, n in carry:  # every carried piece stays here as a guest
                put(e, r, n)
            forward, carry = carried + excess[r], []
            carried = forward
            for e in own[r]:
                out = min(load[e], forward)
                forward -= out
                if out:
                    carry.append([e, out])
                if load[e] - out:
                    put(e, r, load[e] - out)
        else:
            r = light[li]
            li += 1
            for e in own[r]:
                if load[e]:
                    put(e, r, load[e])
            need = -excess[r]
            while need:
                e, n = carry[0]
                take = min(n, need)
                put(e, r, take)
                need -= take
                carried -= take
                if take == n:
                    carry.pop(0)
                else:
                    carry[0][1] = n - take
    assert carried == 0 and not carry, "chain must end with an empty carry"
    return _placement(pieces, home, R)


def plan_static(load: Sequence[int] | torch.Tensor, num_ranks: int, replicas: Sequence[int | tuple[int, ...]]) -> Placement:
    """A placement with fixed copies (e.g. the EPLB anchor, k3/parallel/eplb.py): replicas[e] lists
    the ranks holding expert e (home first); its pairs split evenly over them. Rank loads vary."""
    load = [int(x) for x in (load.tolist() if isinstance(load, torch.Tensor) else load)]
    pieces: dict[tuple[int, int], int] = {}
    for e, ranks in enumerate(replicas):
        ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
        base, extra = divmod(load[e], len(ranks))
        for i, r in enumerate(ranks):
            pieces[(e, r)] = pieces.get((e, r), 0) + base + (i < extra)
    home = [(r,) if isinstance(r, int) else tuple(r) for r in replicas]
    return _placement(pieces, [h[0] for h in home], num_ranks)


def route(counts: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Which rank runs each source rank's pairs. counts [R_src, E] pairs each source routes to each
    expert -> send [R_src, E, R] with send[s, e, r] pairs of (s, e) run on rank r.

    Per expert, the sources' pairs in source order are cut against the hosts' shares in rank
    order (a line cut), so every rank derives the same routing from the same all-gathered counts."""
    _R_src, _E = counts.shape
    tokens = placement.tokens
    if not torch.equal(counts.sum(0).cpu(), tokens.sum(1)):
        raise ValueError("counts do not match the placement's loads")
    src_end = counts.cpu().cumsum(0)  # [R_src, E] end of each source's run within expert e
    src_start = src_end - counts.cpu()
    dst_end = tokens.cumsum(1)  # [E, R]
    dst_start = dst_end - tokens
    # overlap of [src_start, src_end) with [dst_start, dst_end) per (s, e, r)
    lo = torch.maximum(src_start[:, :, None], dst_start[None])
    hi = torch.minimum(src_end[:, :, None], dst_end[None])
    return (hi - lo).clamp_min(0)


def route_rank(counts: torch.Tensor, placement: Placement, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` seen from one rank, in O(R E) instead of O(R^2 E): (send [E, R] pairs of this rank's
    expert-e pairs that run on rank r, recv [R_src, E] pairs of source s's expert e run here)."""
    counts = counts.cpu()
    src_end = counts.cumsum(0)
    src_start = src_end - counts  # [R_src, E]
    dst_end = placement.tokens.cumsum(1)
    dst_start = dst_end - placement.tokens  # [E, R]
    send = (torch.minimum(src_end[rank][:, None], dst_end) - torch.maximum(src_start[rank][:, None], dst_start))
    recv = (torch.minimum(src_end, dst_end[:, rank][None]) - torch.maximum(src_start, dst_start[:, rank][None]))
    return send.clamp_min(0), recv.clamp_min(0)

