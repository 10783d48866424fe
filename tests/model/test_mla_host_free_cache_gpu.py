"""MLA over a cache in host-free mode (k3.ops.host_free) on CUDA, as a captured serving prefill / mixed
step runs it: k3-tiny's MLA layer (hidden 128, 4 heads of 32) in bf16 without gradients continues
per-row cached latents over a packed row (decode rows first, zero-length documents) under the
hints `decode_rows` and `chunk`. It equals the host path on the real documents; captured once in a
CUDA graph on one packing and replayed with OTHER boundaries, lengths and buffer contents, it equals
itself run eagerly on them. `-m gpu`; skipped without CUDA. The CPU side (fp32, every case, no host
reads) is tests/model/test_mla_host_free_cache.py."""
from __future__ import annotations

import pytest
import torch

from bench.common import graphed
from k3.config import load_config
from k3.model.cache import MLAState
from k3.model.mla import GatedMLA
from k3.ops.host_free import check_chunk, host_free
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, EXACT, side_stream, unit_scale_  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("side_stream")]
DEVICE = "cuda"
DECODE_ROWS, CHUNK, CAPACITY = 3, 64, 512  # room for the eager runs and graphed's warm-up writes
# two packings of T = 160 into 8 documents: 3 decode rows first (one empty in A), then up to 64
# tokens each, zero-length documents inside and last
COUNTS_A = [1, 0, 1, 64, 0, 30, 40, 24]
COUNTS_B = [1, 1, 1, 5, 64, 0, 64, 24]


def row(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *counts], device=DEVICE).cumsum(0)


def start_state(cfg, counts: list[int]) -> MLAState:
    """Random latents everywhere (stale rows past the lengths too), random cached lengths per row."""
    buffer = torch.randn(len(counts), CAPACITY, cfg.mla_cache_width, device=DEVICE).bfloat16()
    return MLAState(buffer, torch.randint(0, 100, (len(counts),), device=DEVICE))


@torch.no_grad()
@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
def test_mla_cached_row_host_free_and_captured(nope):
    cfg = load_config("k3-tiny").replace(mla_use_nope=nope)
    layer = unit_scale_(GatedMLA(cfg, layer_idx=3)).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, sum(COUNTS_A), cfg.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    cu = row(COUNTS_A)
    check_chunk(cu.cpu(), CHUNK, DECODE_ROWS)
    check_chunk(row(COUNTS_B).cpu(), CHUNK, DECODE_ROWS)
    kept, empty = (cu.diff() > 0).nonzero().flatten(), cu.diff() == 0
    start = start_state(cfg, COUNTS_A)
    ref_state = start.select(kept)
    ref = layer(x, cu_seqlens=torch.cat([cu[:1], cu[1:][kept]]), state=ref_state)
    state = start.select(slice(None))  # the graph's static state
    with host_free(chunk=CHUNK, decode_rows=DECODE_ROWS):
        out = layer(x, cu_seqlens=cu, state=state)
        assert_rel_close("y host-free vs normal", ref.float(), out.float(), BF16_TOL)
        assert_rel_close("buffer", ref_state.buffer.float(), state.buffer[kept].float(), EXACT)
        assert torch.equal(state.lengths[kept], ref_state.lengths)
        assert torch.equal(state.buffer[empty], start.buffer[empty])
        assert torch.equal(state.lengths[empty], start.lengths[empty])

        graph, static = graphed(lambda: layer(x, cu_seqlens=cu, state=state))
        start_b = start_state(cfg, COUNTS_B)
        x.normal_()
        cu.copy_(row(COUNTS_B))
        state.buffer.copy_(start_b.buffer)
        state.lengths.copy_(start_b.lengths)
        graph.replay()
        want_state = start_b.select(slice(None))
        want = layer(x, cu_seqlens=row(COUNTS_B), state=want_state)
    assert_rel_close("y replay on other boundaries", want.float(), static.float(), EXACT)
    assert_rel_close("buffer replay", want_state.buffer.float(), state.buffer.float(), EXACT)
    assert torch.equal(want_state.lengths, state.lengths)
    empty_b = row(COUNTS_B).diff() == 0
    assert torch.equal(state.buffer[empty_b], start_b.buffer[empty_b])
