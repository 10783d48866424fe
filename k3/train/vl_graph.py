"""A VL training step's rows as a captured step takes them (DESIGN §14.5; k3/train/graph_step.py).

A packed VL row (k3/train/vl_data.py) padded to a fixed shape: its tokens, labels and cu_seqlens as
`pad_batch` pads a text row (the pad tokens one more document, labels ignored, then zero-length
documents), `is_vl` False on the padding, its images' grids as host ints, and the positions of
its image placeholders (found on the host: the image rows are copied there by index, whose backward
reads nothing; a masked scatter's backward selects by the mask, a host read). Within a run every
image has the same size, so the grids are constant; as a host field they join the graph's key, and
the tower reads its grid-derived metadata from its cache (k3/model/vision/layout.py), never the
device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3.model.vision.layout import Grids, host_grids
from k3.train.graph_step import pad_batch
from k3.train.packing import PackedBatch
from k3.train.vl_data import VLBatch


@dataclass
class VLGraphRow:
    input_ids: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T], IGNORE_INDEX on the padding
    cu_seqlens: torch.Tensor  # [docs + 1]
    is_vl: torch.Tensor  # [1, T] bool, False on the padding
    pixel_values: torch.Tensor | None  # [L, 3, P, P], or None (no image in the step)
    image_positions: torch.Tensor  # [M] long: the placeholder tokens' positions, in order
    grids: Grids  # the images' (t, h, w): host metadata, part of the graph's key


def pad_vl_batch(batch: VLBatch, tokens: int, docs: int, pad_id: int, placeholder_id: int) -> VLGraphRow:
    """`batch` (on the host) as a row of exactly `tokens` tokens and `docs` documents."""
    row = pad_batch(PackedBatch(batch.input_ids, batch.labels, batch.cu_seqlens), tokens, docs, pad_id)
    is_vl = F.pad(batch.is_vl, (0, tokens - batch.is_vl.shape[1]), value=False)
    positions = (batch.input_ids[0] == placeholder_id).nonzero().squeeze(1)
    grids = () if batch.grid_thws is None else host_grids(batch.grid_thws)
    return VLGraphRow(row.input_ids, row.labels, row.cu_seqlens, is_vl, batch.pixel_values, positions, grids)
