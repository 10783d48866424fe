"""SFT batches: rendered conversations -> packed rows whose labels are the assistant tokens only.

A conversation is rendered once (k3/text/xtml.py) into token ids and a loss mask that is True
exactly on the tokens an assistant must emit. Inputs are ids[:-1], targets ids[1:], and a target
whose token is not masked in is ignored. Several conversations share one packed row, each its own
`cu_seqlens` segment, so conversations never see each other (DESIGN §2: packing keeps KDA state and
MLA attention inside a document). The order is a pure function of (seed, step), as in pretraining.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from k3.train.packing import IGNORE_INDEX, PackedBatch


@dataclass
class Example:
    ids: np.ndarray  # [n] int64, one rendered conversation
    mask: np.ndarray  # [n] bool, True on tokens the assistant emits
    line: int  # where it came from (1-based line of the JSONL), for messages

    @property
    def targets(self) -> int:
        return int(self.mask[1:].sum())


def example(token_ids: list[int], loss_mask: list[bool], line: int) -> Example:
    if len(token_ids) != len(loss_mask):
        raise ValueError(f"line {line}: {len(token_ids)} tokens but a loss mask of {len(loss_mask)}")
    return Example(np.asarray(token_ids, dtype=np.int64), np.asarray(loss_mask, dtype=bool), line)


def pack_examples(examples: list[Example]) -> PackedBatch:
    """One row: each conversation a segment; labels only where the next token is the assistant's."""
    xs, ys, cu = [], [], [0]
    for ex in examples:
        xs.append(ex.ids[:-1])
        ys.append(np.where(ex.mask[1:], ex.ids[1:], IGNORE_INDEX))
        cu.append(cu[-1] + len(ex.ids) - 1)
    return PackedBatch(torch.from_numpy(np.concatenate(xs))[None], torch.from_numpy(np.concatenate(ys))[None],
                       torch.tensor(cu, dtype=torch.long))


def rows_of(examples: list[Example], max_tokens: int) -> list[list[Example]]:
    """Greedy rows of whole conversations up to `max_tokens` inputs each (eval: no backward, long rows)."""
    rows, row, n = [], [], 0
    for ex in examples:
        if row and n + len(ex.ids) - 1 > max_tokens:
            rows.append(row)
            row, n = [], 0
        row.append(ex)
        n += len(ex.ids) - 1
    if row:
        rows.append(row)
    return rows
