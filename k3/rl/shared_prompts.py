"""An RL batch's log-prob forward with shared prompts run once (k3/train/prefix_tree.py).

A group's samples share their prompt (DESIGN §13.2: advantages are relative within a group) and
every prompt starts with the same system messages, while a packed `RLBatch` carries each
trajectory whole: with K samples of a P-token prompt and C-token completions, the forward and
backward run K * (P + C) tokens where P + K * C carry the same function. Here each trajectory's
tokens up to its first target's input (its prompt but the last token) are its shared prefix, run
once per distinct span of the prefix tree; the completions continue from the cached states.
"""
from __future__ import annotations

import torch

from k3.train.prefix_tree import first_targets, tail_logits


def prompt_split(batch) -> list[int] | None:
    """Per trajectory of an `RLBatch` (k3.rl.objective), its first target position (whose input is
    the prompt's last token), in the packed row. None when sharing does not apply: a prompt of one
    token (nothing to share)."""
    firsts = first_targets(batch.mask, batch.cu_seqlens)
    if firsts is None or any(first == start for start, first in zip(batch.cu_seqlens.tolist(), firsts)):
        return None
    return firsts


def shared_prompt_logits(model, batch) -> torch.Tensor | None:
    """Logits [M, V] fp32 at the batch's masked positions, in their packed order, with shared
    prompt tokens run once; None when nothing is shared or the batch's layout does not allow it
    (the caller then runs the whole packed forward). A tail may have untrained positions (an
    episode row's tool results): they run with it, and their logits are dropped."""
    firsts = prompt_split(batch)
    if firsts is None:
        return None
    logits = tail_logits(model, batch.input_ids, batch.cu_seqlens, firsts)
    if logits is None:
        return None
    ends = batch.cu_seqlens.tolist()[1:]
    keep = torch.cat([batch.mask[first:end] for first, end in zip(firsts, ends)])
    return logits if bool(keep.all()) else logits[keep.to(logits.device)]
