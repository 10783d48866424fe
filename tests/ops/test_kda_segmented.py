"""In-device sequence parallelism for KDA (k3.ops.kda.segmented) on the CPU: the segment algebra
against the token-by-token fp32 reference, over packed batches whose sequences cross segment
boundaries, non-zero initial states and K3's lower-bounded gate (raw, activated inside the op)."""
from __future__ import annotations

import pytest
import torch

from k3.ops.kda import kda
from k3.ops.kda.segmented import auto_segments, segment_bounds
from tests.helpers import assert_rel_close
from tests.helpers.kda import make_gate, make_inputs

H, K, V = 2, 16, 8


def packed(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@pytest.mark.parametrize("segments", [2, 3, 8])
def test_segments_equal_reference_packed_with_states_and_bounded_gate(segments):
    torch.manual_seed(segments)
    lengths = [150, 17, 0, 96]  # a sequence shorter than one segment, an empty one
    q, k, v, _, beta, h0 = make_inputs(1, sum(lengths), H, K, V, "lb", N=len(lengths))
    raw, gate = make_gate(1, sum(lengths), H, K, "lb")
    args = {"initial_state": h0, "output_final_state": True, "cu_seqlens": packed(lengths), "normalize_qk": True,
            "gate": gate, "chunk_size": 16}
    ref = kda(q * 3, k * 3, v, raw, beta, impl="recurrent", **args)  # raw q/k: the op normalizes them
    out = kda(q * 3, k * 3, v, raw, beta, impl="segmented", segments=segments, **args)
    for name, r, o in zip(("o", "final state"), ref, out, strict=True):
        assert_rel_close(name, r, o, 1e-5)


def test_uniform_batch_without_state():
    torch.manual_seed(0)
    q, k, v, g, beta, _ = make_inputs(2, 100, H, K, V, "softplus", with_state=False)
    ref = kda(q, k, v, g, beta, impl="recurrent", output_final_state=True)
    out = kda(q, k, v, g, beta, impl="segmented", segments=4, output_final_state=True, chunk_size=16)
    for name, r, o in zip(("o", "final state"), ref, out, strict=True):
        assert_rel_close(name, r, o, 1e-5)
    assert kda(q, k, v, g, beta, impl="segmented", segments=4, chunk_size=16)[1] is None


def test_segment_bounds_are_chunk_aligned_and_cover_each_sequence():
    bounds = segment_bounds([300, 0, 64, 1], segments=4, align=64)
    assert bounds == [(0, 0, 128), (0, 128, 256), (0, 256, 300), (2, 300, 364), (3, 364, 365)]
    with pytest.raises(ValueError, match="segments must be >= 1"):
        segment_bounds([10], 0)


def test_forward_only_and_never_auto_on_cpu():
    q, k, v, g, beta, _ = (t.requires_grad_() if t is not None else t
                           for t in make_inputs(1, 32, H, K, V, "softplus", with_state=False))
    with pytest.raises(ValueError, match="forward-only"):
        kda(q, k, v, g, beta, impl="segmented", segments=2)
    assert auto_segments(1 << 20, sequences=1, heads=12, device=torch.device("cpu")) == 1
