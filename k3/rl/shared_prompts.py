"""An RL batch's log-prob forward with each distinct prompt run once.

A group's samples share their prompt (seeds §6.1.2: advantages are relative within a group), and
in a packed `RLBatch` every trajectory carries it whole: with K samples of a P-token prompt and
C-token completions, the trainer's forward and backward run K * (P + C) tokens where P + K * C
carry the same function. Here the distinct prompts (all but their last token) run once as one
packed prefill that leaves their KDA states and MLA latents in a cache; each trajectory then
continues its prompt's cache rows, selected for it, from the prompt's last token through its
completion. Gradients through the selected rows sum back into the one prefill, so the loss and
its gradient are the same function of the parameters as the whole packed forward; the arithmetic
differs only where chunk boundaries fall (fp32 rounding), and not at all in batch-invariant mode,
whose per-token arithmetic does not depend on them (k3/ops/batch_invariant.py).
"""
from __future__ import annotations

from itertools import pairwise

import torch

from k3.model.cache import K3Cache


def prompt_split(batch) -> tuple[list[int], list[int]] | None:
    """Per trajectory of an `RLBatch` (k3.rl.objective): where its shared part ends (the first
    target position, whose input is the prompt's last token) and the segment's end, as positions
    in the packed row. None when sharing does not apply: a segment whose targets are not one run
    through its end, or a prompt of one token (nothing to share)."""
    cu = batch.cu_seqlens.tolist()
    mask = batch.mask.tolist()
    firsts = []
    for start, end in pairwise(cu):
        seg = mask[start:end]
        if True not in seg:
            return None
        first = start + seg.index(True)
        if first == start or not all(seg[first - start:]):
            return None
        firsts.append(first)
    return firsts, cu[1:]


def shared_prompt_logits(model, batch) -> torch.Tensor | None:
    """Logits [M, V] fp32 at the batch's masked positions, in their packed order, with each distinct
    prompt run once; None when no prompt repeats or the batch's layout does not allow it (the
    caller then runs the whole packed forward)."""
    split = prompt_split(batch)
    if split is None:
        return None
    firsts, ends = split
    ids = batch.input_ids[0].tolist()  # one read to the host, not one per trajectory
    starts = batch.cu_seqlens.tolist()[:-1]
    prompts: dict[tuple[int, ...], int] = {}
    owner = [prompts.setdefault(tuple(ids[s:f]), len(prompts)) for s, f in zip(starts, firsts)]
    if len(prompts) == len(owner):
        return None
    device = batch.input_ids.device
    dtype = model.lm_head.weight.dtype
    lengths = [len(p) for p in prompts]
    cu_prompts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    prompt_ids = torch.tensor([t for p in prompts for t in p], device=device)[None]
    cache = K3Cache.empty(model.config, len(prompts), device=device, dtype=dtype)
    model(prompt_ids, cu_seqlens=cu_prompts, cache=cache,
          logits_to_keep=torch.empty(0, dtype=torch.long, device=device))
    rows = cache.select(owner)  # copies per trajectory, still in the autograd graph of the prefill
    cont = [t for f, e in zip(firsts, ends) for t in ids[f:e]]
    cu_cont = torch.tensor([0, *torch.tensor([e - f for f, e in zip(firsts, ends)]).cumsum(0).tolist()], device=device)
    return model(torch.tensor(cont, device=device)[None], cu_seqlens=cu_cont, cache=rows)[0]
