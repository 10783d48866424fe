"""Host-free mode (k3.ops.host_free) on the CPU: the device-side document metadata, the masked short
conv, MLA's one masked attention per row and KDA with padded `cu_seqlens` (zero-length documents
up to a fixed count) give the numbers of the normal paths on the real documents, gradients
included, and read nothing on the host (tests.helpers.host_reads). The CUDA capture of the same
paths is tests/ops/test_host_free_gpu.py (`-m gpu`)."""
from __future__ import annotations

import pytest
import torch

import k3.ops.kda as kda_ops
from k3.model.mla import GatedMLA
from k3.model.transformer import K3ForCausalLM
from k3.ops.conv import causal_conv1d
from k3.ops.host_free import host_free
from k3.ops.kda import kda, kda_recurrent
from k3.ops.kda.inputs import check_kda_inputs
from k3.ops.varlen import check_cu_seqlens, token_documents
from tests.helpers import assert_rel_close
from tests.helpers.host_reads import HostRead, allow_host_reads, no_host_reads
from tests.helpers.kda import make_gate, make_inputs
from tests.helpers.models import randomized, small_config

FP32 = 1e-5


def cu(*bounds: int) -> torch.Tensor:
    return torch.tensor(bounds)


# real documents, then zero-length ones; zero-length ones in the middle and first; 1-token documents
ROWS = [cu(0, 5, 6, 13, 13, 13), cu(0, 0, 3, 3, 4, 11, 11), cu(0, 13), cu(0, 1, 2, 3, 13, 13)]


def real(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The same row without its zero-length documents (what the normal paths take)."""
    return torch.cat([cu_seqlens[:1], cu_seqlens[1:][cu_seqlens.diff() > 0]])


@pytest.mark.parametrize("read", [lambda x: x.tolist(), lambda x: x.sum().item(), lambda x: bool(x.sum() > 0),
                                  lambda x: x[x > 0], lambda x: x.nonzero(),
                                  lambda x: torch.repeat_interleave(x.long().abs())])
def test_the_checker_catches_host_reads(read):
    x = torch.randn(4)
    with no_host_reads(), pytest.raises(HostRead):
        read(x)


def test_the_checker_catches_a_read_inside_a_kernel():
    """masked_scatter's backward selects by the mask inside its own kernel: a host read on CUDA."""
    x = torch.randn(4, 3, requires_grad=True)
    rows = torch.randn(12, requires_grad=True)  # the source's gradient is the masked select
    y = x.masked_scatter(torch.tensor([True, False, True, False])[:, None].expand(4, 3), rows)
    with no_host_reads(), pytest.raises(HostRead, match="masked_scatter_backward"):
        y.sum().backward()


@pytest.mark.parametrize("row", ROWS, ids=str)
def test_token_documents_skip_zero_length_documents(row):
    T = int(row[-1])
    doc, pos = token_documents(row, T)
    bounds = row.tolist()
    want = [max(n for n in range(len(bounds) - 1) if bounds[n] <= t < bounds[n + 1]) for t in range(T)]
    assert doc.tolist() == want
    assert pos.tolist() == [t - bounds[n] for t, n in zip(range(T), want)]
    with no_host_reads():
        token_documents(row.int(), T)


def test_check_cu_seqlens_checks_shapes_only():
    with host_free(), no_host_reads():
        assert check_cu_seqlens(ROWS[0], 1, 13) == 5
        with pytest.raises(ValueError, match="batch size 1"):
            check_cu_seqlens(ROWS[0], 2, 13)
        with pytest.raises(ValueError, match="integer"):
            check_cu_seqlens(ROWS[0].float(), 1, 13)
    with pytest.raises(ValueError, match="end at T"):  # outside the mode the values are checked, as before
        check_cu_seqlens(ROWS[0], 1, 12)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_masked_equals_reference(activation):
    """Documents shorter than the kernel width (1, 2, 3 tokens), zero-length ones, fp32."""
    row = cu(0, 1, 3, 6, 14, 14, 14)
    x = torch.randn(1, 14, 6, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    ref = causal_conv1d(x, w, cu_seqlens=real(row), activation=activation, impl="torch")[0]
    with host_free(), no_host_reads():
        out, tails = causal_conv1d(x, w, cu_seqlens=row, activation=activation)
        dy = torch.randn_like(out)
        grads = torch.autograd.grad(out, (x, w), dy)
    assert tails is None
    assert_rel_close("y", ref, out, FP32)
    for name, r, o in zip(("dx", "dw"), torch.autograd.grad(ref, (x, w), dy), grads, strict=True):
        assert_rel_close(name, r, o, FP32)


@pytest.mark.parametrize("impl,use_nope", [("naive", True), ("absorb", True), ("naive", False)])
def test_mla_one_masked_attention_equals_per_document_loop(impl, use_nope):
    cfg = small_config(mla_impl=impl, mla_use_nope=use_nope)
    layer = GatedMLA(cfg, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    for row in ROWS[:2] + ROWS[3:]:
        x = torch.randn(1, int(row[-1]), cfg.hidden_size, requires_grad=True)
        ref = layer(x, cu_seqlens=real(row))
        dy = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, (x, *layer.parameters()), dy)
        with host_free(), no_host_reads():
            out = layer(x, cu_seqlens=row)
            grads = torch.autograd.grad(out, (x, *layer.parameters()), dy)
        assert_rel_close(f"{row.tolist()} y", ref, out, FP32)
        for n, (r, o) in enumerate(zip(ref_grads, grads, strict=True)):
            assert_rel_close(f"{row.tolist()} grad {n}", r, o, FP32)


@pytest.mark.parametrize("impl", ["naive", "absorb"])
def test_mla_attends_window_by_window_when_no_document_crosses_a_window(impl):
    """host_free(segment=4): a row of whole 4-token windows attends [4, 4] per window, as the loop."""
    cfg = small_config(mla_impl=impl)
    layer = GatedMLA(cfg, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    row = cu(0, 1, 4, 8, 10, 12, 12, 12)  # windows [0,4) [4,8) [8,12); a zero-length tail
    x = torch.randn(1, 12, cfg.hidden_size)
    ref = layer(x, cu_seqlens=real(row))
    with host_free(segment=4), no_host_reads():
        out = layer(x, cu_seqlens=row)
    assert_rel_close("y", ref, out, FP32)


def test_kda_with_zero_length_documents_equals_recurrence():
    """The CPU chunk path (which may read the lengths) on a padded row = the recurrence on the real
    documents; the op's input checks read nothing in the mode."""
    row = cu(0, 5, 6, 40, 40, 40)
    q, k, v, _, beta, _ = make_inputs(1, 40, 2, 8, 8, "lb", with_state=False)
    g_raw, gate = make_gate(1, 40, 2, 8, "lb")
    ref, _ = kda_recurrent(q, k, v, kda_ops.activate_gate(g_raw, gate), beta, cu_seqlens=real(row))
    with host_free():
        with no_host_reads():
            assert check_kda_inputs(q, k, v, g_raw, beta, None, row) == 5
        out, _ = kda(q, k, v, g_raw, beta, cu_seqlens=row, gate=gate, chunk_size=16)
    assert_rel_close("o", ref, out, FP32)


def test_model_forward_backward_reads_nothing_on_the_host(monkeypatch):
    """k3-tiny shrunk (KDA, MLA with RoPE positions, dense and MoE layers, AttnRes), forward and
    backward on a padded row inside `host_free()`: no host read anywhere but in KDA's CPU chunk
    backend, exempted here (on CUDA fla's device-built chunk list replaces it, captured in the GPU
    tests); the routed experts take their padded batched GEMM (k3/model/experts.py). The logits and
    gradients equal the normal path's on the real documents."""
    monkeypatch.setattr(kda_ops, "kda_split_decode_rows", allow_host_reads(kda_ops.kda_split_decode_rows))
    model = randomized(K3ForCausalLM(small_config(mla_use_nope=False))).train()
    row = cu(0, 3, 4, 20, 20, 20)
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    params = [p for p in model.parameters() if p.requires_grad]
    ref = model(ids, cu_seqlens=real(row))
    ref_grads = torch.autograd.grad(ref.square().mean(), params, materialize_grads=True)
    with host_free(), no_host_reads():
        out = model(ids, cu_seqlens=row)
        grads = torch.autograd.grad(out.square().mean(), params, materialize_grads=True)
    assert_rel_close("logits", ref, out, FP32)
    for n, (r, o) in enumerate(zip(ref_grads, grads, strict=True)):
        assert_rel_close(f"grad {n}", r, o, 1e-4)


def test_decode_rows_pass_zero_length_documents_through():
    """Short rows split off for the recurrence, long ones chunked, empty ones keep their state."""
    from k3.ops.kda.decode_rows import kda_split_decode_rows

    row = cu(0, 5, 5, 30, 31, 31, 31)
    q, k, v, g, beta, h0 = make_inputs(1, 31, 2, 8, 8, "lb", with_state=False)
    h0 = torch.randn(6, 2, 8, 8)
    ref, ref_state = kda_recurrent(q, k, v, g, beta, cu_seqlens=row, initial_state=h0, output_final_state=True)
    out, state = kda_split_decode_rows(q, k, v, g, beta, cu_seqlens=row, initial_state=h0, output_final_state=True,
                                       chunk_size=16)
    assert_rel_close("o", ref, out, FP32)
    assert_rel_close("state", ref_state, state, FP32)
    torch.testing.assert_close(state[[1, 4, 5]], h0[[1, 4, 5]])
