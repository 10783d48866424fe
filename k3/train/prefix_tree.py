"""A packed row's training forward with shared prefixes run once: a radix tree of prefill caches.

Post-training rows repeat their beginnings: an RL group's samples share the whole prompt, and
every conversation of an SFT set starts with the same system messages (the thinking-effort message,
often the same tool declarations). When the tokens before a segment's first loss target are
`prefix_n`, the segments' prefixes form a tree: a node is a token span shared by every segment
below it. Each node runs once, as a prefill continuing its parent's cache rows (all nodes of one
depth in one packed forward), and each segment's tail, from its `share_end` through its end,
continues the cache of the node where its prefix ends. Gradients through the selected cache rows
sum back into the one prefill of each span, so the loss and its gradient are the same function of
the parameters as the whole packed forward; the arithmetic differs only where chunk boundaries
fall (fp32 rounding), and not at all in batch-invariant mode (k3/ops/batch_invariant.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch

from k3.model.cache import K3Cache, KDAState, MLAState


@dataclass
class _Node:
    span: list[int]  # the tokens this node adds to its parent's prefix
    parent: int = -1  # its parent's row in the level above (set when the levels run; -1: the root)
    children: list[_Node] = field(default_factory=list)
    leaves: list[int] = field(default_factory=list)  # segments whose prefix ends here


def _tree(prefixes: list[list[int]]) -> _Node:
    """The radix tree of the prefixes (the root's span may be empty; every other span is not)."""
    def build(members: list[int], depth: int) -> _Node:
        end = min(len(prefixes[m]) for m in members)
        first = prefixes[members[0]]
        for m in members[1:]:  # the longest run all members share from `depth`
            p = prefixes[m]
            k = depth
            while k < end and p[k] == first[k]:
                k += 1
            end = k
        node = _Node(first[depth:end])
        groups: dict[int, list[int]] = {}
        for m in members:
            if len(prefixes[m]) == end:
                node.leaves.append(m)
            else:
                groups.setdefault(prefixes[m][end], []).append(m)
        node.children = [build(g, end) for g in groups.values()]
        return node

    return build(list(range(len(prefixes))), 0)


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)


def _span_tokens(node: _Node) -> int:
    return len(node.span) + sum(_span_tokens(c) for c in node.children)


def _cat_caches(caches: list[K3Cache]) -> K3Cache:
    """One cache holding the rows of several, in order (MLA buffers padded to the longest)."""
    if len(caches) == 1:
        return caches[0]
    layers = []
    for states in zip(*(c.layers for c in caches)):
        if isinstance(states[0], KDAState):
            layers.append(KDAState(torch.cat([s.conv for s in states]), torch.cat([s.recurrent for s in states])))
        else:
            cap = max(s.capacity for s in states)
            bufs = [torch.nn.functional.pad(s.buffer, (0, 0, 0, cap - s.capacity)) for s in states]
            layers.append(MLAState(torch.cat(bufs), torch.cat([s.lengths for s in states])))
    return K3Cache(layers, torch.cat([c.lengths for c in caches]))


def first_targets(targeted: torch.Tensor, cu_seqlens: torch.Tensor) -> list[int] | None:
    """Each segment's first position whose output carries a loss (`targeted` [T] bool): the share
    ends a packed row's callers pass to `tail_logits`. None when a segment has none."""
    flags = targeted.tolist()
    firsts = []
    for start, end in pairwise(cu_seqlens.tolist()):
        first = next((p for p in range(start, end) if flags[p]), None)
        if first is None:
            return None
        firsts.append(first)
    return firsts


def tail_logits(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, share_ends: list[int]) -> torch.Tensor | None:
    """Logits [sum of tails, V] of every position from each segment's `share_ends[n]` (a position in
    the packed row, inside segment n) through its end, in packed order, with the tokens before
    those positions run once per distinct prefix. None when no prefix shares any token with
    another (the caller then runs the whole packed forward)."""
    ids = input_ids[0].tolist()  # one read to the host
    bounds = list(pairwise(cu_seqlens.tolist()))
    if len(share_ends) != len(bounds) or any(not a <= e < b for (a, b), e in zip(bounds, share_ends)):
        raise ValueError("each share end must lie inside its segment, before its last position")
    prefixes = [ids[start:share] for (start, _), share in zip(bounds, share_ends)]
    root = _tree(prefixes)
    if _span_tokens(root) == sum(map(len, prefixes)):
        return None  # no token is shared
    device = input_ids.device
    dtype = model.lm_head.weight.dtype
    empty = torch.empty(0, dtype=torch.long, device=device)
    # level by level: every node of a level runs in one packed forward from its parent's rows
    leaf_rows: dict[int, tuple[int, int]] = {}  # segment -> (level, row)
    levels: list[K3Cache] = []
    level = [root]
    while level:
        spans = [n.span for n in level]
        if levels:
            cache = levels[-1].select([n.parent for n in level])
        else:
            cache = K3Cache.empty(model.config, len(level), device=device, dtype=dtype)
        if any(spans):
            if not all(spans):
                raise AssertionError("only the root may have an empty span")
            model(torch.tensor([t for s in spans for t in s], device=device)[None],
                  cu_seqlens=_cu([len(s) for s in spans], device), cache=cache, logits_to_keep=empty)
        levels.append(cache)
        nxt = []
        for row, node in enumerate(level):
            for seg in node.leaves:
                leaf_rows[seg] = (len(levels) - 1, row)
            for child in node.children:
                child.parent = row
                nxt.append(child)
        level = nxt
    # the tails, each from its node's rows: one packed forward
    per_level = [[] for _ in levels]
    for seg in range(len(prefixes)):
        lvl, row = leaf_rows[seg]
        per_level[lvl].append((seg, row))
    order = [seg for group in per_level for seg, _ in group]
    cache = _cat_caches([levels[lvl].select([row for _, row in group]) for lvl, group in enumerate(per_level) if group])
    tails = [ids[share_ends[s]:bounds[s][1]] for s in order]
    logits = model(torch.tensor([t for tail in tails for t in tail], device=device)[None],
                   cu_seqlens=_cu([len(t) for t in tails], device), cache=cache)[0]
    if order == sorted(order):
        return logits
    # back to packed order
    pieces = dict(zip(order, logits.split([len(t) for t in tails]), strict=True))
    return torch.cat([pieces[s] for s in range(len(prefixes))])
