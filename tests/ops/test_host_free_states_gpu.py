"""Host-free mode (k3.ops.host_free) with carried states on CUDA, as a captured serving prefill runs
it: fla's KDA (`use_graph`) with an initial state per entry of the padded `cu_seqlens`, the masked
conv with initial and final tails, and a KDA layer continuing its cached states in place, in bf16
without gradients. Each equals the normal path on the real documents (fla's kernels), zero-length
documents keep their states exactly, and the layer's step captured once in a CUDA graph and replayed
with OTHER document boundaries and states equals it run eagerly on them. `-m gpu`; skipped without
CUDA or fla+triton. Small shapes (T 512, k3-tiny's 4 heads of 32); the CPU side is
tests/ops/test_host_free_states.py."""
from __future__ import annotations

import pytest
import torch

from bench.common import graphed
from k3.model.cache import KDAState
from k3.model.kda import KimiDeltaAttention
from k3.ops import fla_kernels
from k3.ops.conv import causal_conv1d
from k3.ops.host_free import host_free
from k3.ops.kda import kda
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, EXACT, side_stream, unit_scale_  # noqa: F401 (a fixture)
from tests.helpers.kda import make_gate, make_inputs
from tests.helpers.models import small_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_kernels.available(), reason="needs fla-core with triton"),
              pytest.mark.usefixtures("side_stream")]
T, H, K, W = 512, 4, 32, 4  # k3-tiny's KDA heads: its runs leave these fla kernels in the Triton cache
# two packings of T into at most 7 documents: 1- and 2-token ones (shorter than W-1), zero-length
# ones first, inside and at the end
ROW_A = [0, 0, 100, 101, 400, 512, 512, 512]
ROW_B = [0, 37, 37, 300, 301, 303, 511, 512]


def cu(bounds: list[int]) -> torch.Tensor:
    return torch.tensor(bounds, device="cuda")


def real(bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens of the real documents, their indices, the zero-length documents' mask)."""
    row = cu(bounds)
    empty = row.diff() == 0
    return cu(sorted(set(bounds))), (~empty).nonzero().flatten(), empty


@torch.no_grad()
@pytest.mark.parametrize("in_place", [False, True])
def test_kda_fla_initial_states(in_place):
    q, k, v, _, beta, _ = make_inputs(1, T, H, K, K, "lb", with_state=False)
    g_raw, gate = make_gate(1, T, H, K, "lb")
    q, k, v, g_raw, beta = (t.cuda() for t in (q.bfloat16(), k.bfloat16(), v.bfloat16(), g_raw, beta))
    gate = type(gate)(gate.A_log.cuda(), gate.dt_bias.cuda(), gate.lower_bound)
    h0 = torch.randn(len(ROW_A) - 1, H, K, K, device="cuda")
    cu_real, kept, empty = real(ROW_A)
    run = {"gate": gate, "normalize_qk": True, "output_final_state": True}
    ref, ref_state = kda(q, k, v, g_raw, beta, cu_seqlens=cu_real, initial_state=h0[kept], **run)
    state = h0.clone()
    with host_free():
        out, final = kda(q, k, v, g_raw, beta, cu_seqlens=cu(ROW_A), initial_state=state,
                         update_state_in_place=in_place, **run)
    assert (final is state) == in_place
    assert_rel_close("o", ref.float(), out.float(), BF16_TOL)
    assert_rel_close("state", ref_state, final[kept], BF16_TOL)
    assert torch.equal(final[empty], h0[empty])


@torch.no_grad()
def test_conv_tails_fla_vs_masked():
    x = torch.randn(1, T, H * K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(H * K, W, device="cuda") / 2).bfloat16()
    h0 = torch.randn(len(ROW_B) - 1, H * K, W - 1, device="cuda").bfloat16()
    cu_real, kept, empty = real(ROW_B)
    ref, ref_tails = causal_conv1d(x, w, cu_seqlens=cu_real, initial_state=h0[kept], output_final_state=True,
                                   activation="silu")
    with host_free():
        out, tails = causal_conv1d(x, w, cu_seqlens=cu(ROW_B), initial_state=h0, output_final_state=True,
                                   activation="silu")
    assert_rel_close("y", ref.float(), out.float(), BF16_TOL)
    assert torch.equal(tails[kept], ref_tails)  # copies of inputs either way
    assert torch.equal(tails[empty], h0[empty])


@torch.no_grad()
def test_kda_layer_with_states_captured():
    """The engine's packed prefill in one KDA layer: conv tails and recurrent states continued and
    updated in place. Host-free on ROW_A = normal on its real documents; captured on ROW_A, replayed
    on ROW_B with other states = host-free eager on ROW_B; zero-length documents untouched."""
    cfg = small_config(hidden_size=128, kda_head_dim=K, kda_num_heads=H, kda_chunk_size=64)
    layer = unit_scale_(KimiDeltaAttention(cfg, layer_idx=0)).to("cuda", torch.bfloat16)
    N = len(ROW_A) - 1

    def states() -> KDAState:
        s = KDAState.empty(cfg, N, device="cuda", dtype=torch.bfloat16)
        s.conv.normal_()
        s.recurrent.normal_(0, 0.5)
        return s

    x = torch.randn(1, T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    start_a = states()
    cu_real, kept, empty = real(ROW_A)
    ref_state = start_a.select(kept)
    ref = layer(x, cu_seqlens=cu_real, state=ref_state)
    state, row = start_a.select(slice(None)), cu(ROW_A)  # the graph's static state and boundaries
    with host_free():
        out = layer(x, cu_seqlens=row, state=state)
        assert_rel_close("y host-free vs normal", ref.float(), out.float(), BF16_TOL)
        assert_rel_close("conv tails", ref_state.conv.float(), state.conv[kept].float(), EXACT)
        assert_rel_close("recurrent", ref_state.recurrent, state.recurrent[kept], BF16_TOL)
        assert torch.equal(state.conv[empty], start_a.conv[empty])
        assert torch.equal(state.recurrent[empty], start_a.recurrent[empty])

        graph, static = graphed(lambda: layer(x, cu_seqlens=row, state=state))
        start_b = states()
        row.copy_(cu(ROW_B))
        state.conv.copy_(start_b.conv)
        state.recurrent.copy_(start_b.recurrent)
        graph.replay()
        want_state = start_b.select(slice(None))
        want = layer(x, cu_seqlens=cu(ROW_B), state=want_state)
    assert_rel_close("y replay on other boundaries", want.float(), static.float(), EXACT)
    assert_rel_close("conv tails replay", want_state.conv.float(), state.conv.float(), EXACT)
    assert_rel_close("recurrent replay", want_state.recurrent, state.recurrent, EXACT)
    empty_b = real(ROW_B)[2]
    assert torch.equal(state.recurrent[empty_b], start_b.recurrent[empty_b])
