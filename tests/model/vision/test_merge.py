"""`sd2_tpool` merge (DESIGN §7) against transformers' Kimi-K2.5 vectorized temporal merge, which
has the official `tpool_patch_merger` semantics (mean over frames, kh x kw windows)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

from k3.model.vision.merge import merged_counts, tpool_merge
from tests.helpers import assert_rel_close
from tests.model.vision.helpers import GRIDS


def test_merge_matches_transformers():
    g = torch.tensor(GRIDS)
    x = torch.randn(int(g.prod(-1).sum()), 16)
    theirs = Kimi_K25VisionModel.temporal_merge(None, x, g, 2, 2)  # uses no module state
    assert_rel_close("merge", theirs, tpool_merge(x, g, (2, 2)), 1e-7)
    assert merged_counts(g, (2, 2)) == [6, 2, 30, 16]


def test_window_order_on_a_known_grid():
    # one 2 x 4 image, patch value = its raster index: windows [0, 1, 4, 5] and [2, 3, 6, 7]
    x = torch.arange(8.0)[:, None]
    out = tpool_merge(x, torch.tensor([(1, 2, 4)]), (2, 2))
    assert out[..., 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # two frames: the mean over frames
    x2 = torch.cat([x, x + 8])
    assert tpool_merge(x2, torch.tensor([(2, 2, 4)]), (2, 2))[..., 0].tolist() == [[4, 5, 8, 9], [6, 7, 10, 11]]


def test_grid_not_tiling_the_kernel_is_an_error():
    with pytest.raises(ValueError, match="3 x 4"):
        tpool_merge(torch.zeros(12, 4), torch.tensor([(1, 3, 4)]), (2, 2))
