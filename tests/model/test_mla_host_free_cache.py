"""MLA over a cache in host-free mode (k3.ops.host_free), as a captured serving prefill / mixed step
runs it: a packed row with one document per cache row (decode rows first, zero-length documents
inside and last, per-row cached lengths) under the hints `decode_rows` and `chunk` equals the
host path `_extend_packed` on the real documents (outputs, buffer, lengths; fp32), twice in a row
(chunked prefill), reads nothing on the host and leaves zero-length rows as they were. The CUDA
capture is tests/model/test_mla_host_free_cache_gpu.py (`-m gpu`)."""
from __future__ import annotations

import pytest
import torch

from k3.model.cache import MLAState
from k3.model.mla import GatedMLA
from k3.ops import host_free as hf
from k3.ops.host_free import check_chunk, host_free
from tests.helpers import assert_rel_close
from tests.helpers.host_reads import no_host_reads
from tests.helpers.models import small_config

FP32 = 1e-5
# (documents' new tokens, decode_rows, chunk): one-token decode rows first (one of them empty),
# zero-length documents inside and last, every document in the grid, every document a decode row
CASES = [([1, 1, 0, 1, 3, 0, 5, 2, 0], 4, 5), ([0, 1, 2, 0, 4, 0, 0], 1, 4), ([2, 1, 6], 0, None),
         ([1, 0, 1, 1], 4, 2)]


def row(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *counts]).cumsum(0)


def real(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row without its zero-length documents, the indices of the documents kept)."""
    kept = (cu.diff() > 0).nonzero().flatten()
    return torch.cat([cu[:1], cu[1:][kept]]), kept


@torch.no_grad()
@pytest.mark.parametrize("impl,gate,nope", [("auto", True, True), ("naive", True, True), ("absorb", False, True),
                                            ("auto", False, False)])
def test_host_free_cached_row_equals_host_path(impl, gate, nope):
    cfg = small_config(mla_impl=impl, mla_use_output_gate=gate, mla_use_nope=nope)
    layer = GatedMLA(cfg, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    for counts, decode_rows, chunk in CASES:
        cu = row(counts)
        cu_real, kept = real(cu)
        N, T = len(counts), int(cu[-1])
        # stale finite rows past every length, as the serving slots keep them
        state = MLAState(torch.randn(N, 20, cfg.mla_cache_width), torch.randint(0, 7, (N,)))
        start = MLAState(state.buffer.clone(), state.lengths.clone())
        ref_state = start.select(kept)
        for step in range(2):  # the second call continues the first: chunked prefill
            x = torch.randn(1, T, cfg.hidden_size)
            ref = layer(x, cu_seqlens=cu_real, state=ref_state)
            check_chunk(cu, chunk, decode_rows)
            buffer = state.buffer
            with host_free(chunk=chunk, decode_rows=decode_rows), no_host_reads():
                out = layer(x, cu_seqlens=cu, state=state)
            name = f"{counts} step {step}"
            assert state.buffer is buffer  # written in place under no_grad
            assert_rel_close(f"{name} y", ref, out, FP32)
            assert_rel_close(f"{name} buffer", ref_state.buffer, state.buffer[kept], FP32)
            assert torch.equal(state.lengths[kept], ref_state.lengths)
            empty = cu.diff() == 0
            assert torch.equal(state.buffer[empty], start.buffer[empty])
            assert torch.equal(state.lengths[empty], start.lengths[empty])


def test_hints_are_checked_on_the_host():
    cu = row([1, 0, 1, 3, 5])
    check_chunk(cu, 5, 3)
    check_chunk(cu.tolist(), None, 0)
    with pytest.raises(ValueError, match="more than chunk=4"):  # a graph keyed on chunk 4 would cut document 4
        check_chunk(cu, 4, 3)
    with pytest.raises(ValueError, match="decode row 3 has 3"):
        check_chunk(cu, 5, 4)
    with pytest.raises(ValueError, match="decode_rows=6"):
        check_chunk(cu, 5, 6)
    with pytest.raises(ValueError, match="chunk must be >= 1"), host_free(chunk=0):
        pass
    with host_free(chunk=4, decode_rows=2):
        with host_free():  # nested: no promises inside, restored after
            assert (hf.chunk(), hf.decode_rows()) == (None, 0)
        assert (hf.chunk(), hf.decode_rows()) == (4, 2)
    assert not hf.active() and (hf.chunk(), hf.decode_rows()) == (None, 0)
    layer = GatedMLA(small_config(), 3)
    state = MLAState.empty(layer.config, 2, capacity=8)
    with torch.no_grad(), host_free(decode_rows=3), pytest.raises(ValueError, match="decode_rows=3"):
        layer(torch.randn(1, 2, 64), cu_seqlens=row([1, 1]), state=state)
