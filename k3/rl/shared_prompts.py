"""An RL batch's log-prob forward with shared prompts run once (k3/train/prefix_tree.py).

A group's samples share their prompt (seeds §6.1.2: advantages are relative within a group) and
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
    the prompt's last token), in the packed row. None when sharing does not apply: a segment whose
    targets are not one run through its end, or a prompt of one token (nothing to share)."""
    firsts = first_targets(batch.mask, batch.cu_seqlens)
    if firsts is None:
        return None
    mask = batch.mask.tolist()
    for start, first, end in zip(batch.cu_seqlens.tolist(), firsts, batch.cu_seqlens.tolist()[1:]):
        if first == start or not all(mask[first:end]):
            return None
    return firsts


def shared_prompt_logits(model, batch) -> torch.Tensor | None:
    """Logits [M, V] fp32 at the batch's masked positions, in their packed order, with shared
    prompt tokens run once; None when nothing is shared or the batch's layout does not allow it
    (the caller then runs the whole packed forward)."""
    firsts = prompt_split(batch)
    return None if firsts is None else tail_logits(model, batch.input_ids, batch.cu_seqlens, firsts)
