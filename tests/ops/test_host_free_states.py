"""Host-free mode (k3.ops.host_free) with carried states, as a captured serving prefill runs it: every
packed document continues a cached sequence. The masked conv with initial and final tails and KDA
with initial and final recurrent states, on a row whose fixed-length `cu_seqlens` ends in (or holds)
zero-length documents, equal the normal paths on the real documents, leave a zero-length
document's state as it was, and the conv reads nothing on the host. The CUDA side (fla, graph
capture) is tests/ops/test_host_free_states_gpu.py (`-m gpu`)."""
from __future__ import annotations

import pytest
import torch

import k3.ops.kda as kda_ops
from k3.ops.conv import causal_conv1d
from k3.ops.host_free import host_free
from k3.ops.kda import kda, kda_recurrent
from tests.helpers import assert_rel_close
from tests.helpers.host_reads import allow_host_reads, no_host_reads
from tests.helpers.kda import clone_state, make_inputs, make_layer, random_state

FP32 = 1e-5
W = 4
# documents of 0 (first, inside, tails), 1, W-2, W-1, W and 9 tokens; N_max > real N
ROWS = [torch.tensor([0, 0, 1, 3, 6, 10, 19, 19, 19]), torch.tensor([0, 19, 19]), torch.tensor([0, 2, 2, 3, 19])]


def real_docs(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row without its zero-length documents, the indices of the documents kept)."""
    kept = (row.diff() > 0).nonzero().flatten()
    return torch.cat([row[:1], row[1:][kept]]), kept


@pytest.mark.parametrize("row", ROWS, ids=lambda r: str(r.tolist()))
def test_conv_with_tails_equals_reference(row):
    T, C, N = int(row[-1]), 6, row.numel() - 1
    x = torch.randn(1, T, C, requires_grad=True)
    w = torch.randn(C, W, requires_grad=True)
    # a strided view, as the layer hands each stream's slice of its state
    h0 = torch.randn(N, 3 * C, W - 1)[:, C:2 * C].requires_grad_()
    cu, kept = real_docs(row)
    for activation in (None, "silu"):
        ref, ref_tails = causal_conv1d(x, w, cu_seqlens=cu, initial_state=h0[kept], output_final_state=True,
                                       activation=activation, impl="torch")
        with host_free(), no_host_reads():
            out, tails = causal_conv1d(x, w, cu_seqlens=row, initial_state=h0, output_final_state=True,
                                       activation=activation)
        assert_rel_close(f"{activation} y", ref, out, FP32)
        assert torch.equal(tails[kept], ref_tails)  # tails are copies of inputs: exact
        empty = row.diff() == 0
        assert torch.equal(tails[empty], h0[empty])
    dy = torch.randn_like(out)  # gradients of y (the tails' are not needed: serving runs under no_grad)
    for name, r, o in zip(("dx", "dw", "dh0"), torch.autograd.grad(ref, (x, w, h0), dy),
                          torch.autograd.grad(out, (x, w, h0), dy), strict=True):
        assert_rel_close(name, r, o, FP32)


def test_conv_tails_one_way_only():
    """Initial tails without final ones, final tails from zero tails; bf16 x with fp32 tails."""
    row = ROWS[0]
    T, C, N = int(row[-1]), 6, row.numel() - 1
    x, w, h0 = torch.randn(1, T, C), torch.randn(C, W), torch.randn(N, C, W - 1)
    cu, kept = real_docs(row)
    with host_free(), no_host_reads():
        out, none = causal_conv1d(x, w, cu_seqlens=row, initial_state=h0)
        _, tails = causal_conv1d(x, w, cu_seqlens=row, output_final_state=True)
        bf, bf_tails = causal_conv1d(x.bfloat16(), w, cu_seqlens=row, initial_state=h0, output_final_state=True)
    assert none is None
    assert_rel_close("y", causal_conv1d(x, w, cu_seqlens=cu, initial_state=h0[kept], impl="torch")[0], out, FP32)
    assert torch.equal(tails[kept], causal_conv1d(x, w, cu_seqlens=cu, output_final_state=True, impl="torch")[1])
    assert not tails[row.diff() == 0].any()  # zero-length documents keep their (zero) tails
    ref, ref_tails = causal_conv1d(x.bfloat16(), w, cu_seqlens=cu, initial_state=h0[kept], output_final_state=True,
                                   impl="torch")
    assert bf.dtype == bf_tails.dtype == torch.bfloat16
    assert_rel_close("bf16 y", ref.float(), bf.float(), 1e-2)
    assert torch.equal(bf_tails[kept], ref_tails)


@pytest.mark.parametrize("in_place", [False, True])
def test_kda_with_initial_states_and_zero_length_documents(in_place):
    """The CPU chunk path (the host-free mode's CPU backend) with a state per entry of the padded row
    = the recurrence on the real documents; zero-length documents keep their state, also in place."""
    row = torch.tensor([0, 0, 5, 6, 40, 40, 40])
    q, k, v, g, beta, _ = make_inputs(1, 40, 2, 8, 8, "lb", with_state=False)
    h0 = torch.randn(6, 2, 8, 8)
    cu, kept = real_docs(row)
    ref, ref_state = kda_recurrent(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0[kept], output_final_state=True)
    state = h0.clone()
    with host_free():
        out, final = kda(q, k, v, g, beta, cu_seqlens=row, initial_state=state, output_final_state=True,
                         chunk_size=16, update_state_in_place=in_place)
    assert (final is state) == in_place
    assert_rel_close("o", ref, out, FP32)
    assert_rel_close("state", ref_state, final[kept], FP32)
    assert torch.equal(final[row.diff() == 0], h0[row.diff() == 0])


def test_kda_layer_continues_states_in_host_free_mode(monkeypatch):
    """The engine's packed prefill: a KDA layer (conv tails and recurrent state, updated in place
    under no_grad) on a padded row = the normal path on the real documents; zero-length documents'
    states untouched; nothing read on the host but by KDA's CPU chunk backend (fla on CUDA)."""
    monkeypatch.setattr(kda_ops, "kda_split_decode_rows", allow_host_reads(kda_ops.kda_split_decode_rows))
    layer = make_layer("lb")
    row = torch.tensor([0, 3, 3, 4, 20, 20])
    cu, kept = real_docs(row)
    x = torch.randn(1, 20, layer.config.hidden_size)
    state = random_state(layer.config, 5)
    before = clone_state(state)
    ref_state = before.select(kept)  # the real documents' states, copied
    with torch.no_grad():
        ref = layer(x, cu_seqlens=cu, state=ref_state)
        with host_free(), no_host_reads():
            out = layer(x, cu_seqlens=row, state=state)
    assert_rel_close("y", ref, out, FP32)
    assert torch.equal(state.conv[kept], ref_state.conv)
    assert_rel_close("recurrent", ref_state.recurrent, state.recurrent[kept], FP32)
    empty = row.diff() == 0
    assert torch.equal(state.conv[empty], before.conv[empty])
    assert torch.equal(state.recurrent[empty], before.recurrent[empty])

