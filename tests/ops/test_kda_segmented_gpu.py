"""In-device sequence parallelism for KDA (k3.ops.kda.segmented) on CUDA: the segmented path over
fla's kernels equals fla's `chunk_kda` on the same bf16 inputs within the bf16 bar, at long lengths
(4K, 64K, 256K tokens), several segment counts, packed sequences crossing segment boundaries,
non-zero initial states and K3's lower-bounded gate activated in the kernel; in fp32 (the torch
chunk kernel underneath) it equals the fp32 chunk path within 1e-5. Two heads: the heads do not
change the algebra, and the speed is bench.kda_segments' business. `-m gpu`."""
from __future__ import annotations

import pytest
import torch

from k3.ops import fla_kernels
from k3.ops.kda import kda
from k3.ops.kda.segmented import auto_segments
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, EXACT
from tests.helpers.kda import make_gate, make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_kernels.available(), reason="needs fla-core with triton")]
H, K = 2, 128


def case(T: int, dtype: torch.dtype, seed: int = 0):
    """Three packed sequences (60%, 30% + 13, the rest of T): boundaries inside segments."""
    torch.manual_seed(seed)
    lengths = [int(T * 0.6), int(T * 0.3) + 13]
    lengths.append(T - sum(lengths))
    q, k, v, _, beta, h0 = make_inputs(1, T, H, K, K, "lb", N=3)
    raw, gate = make_gate(1, T, H, K, "lb")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, raw, beta = (t.cuda().to(dtype) for t in (q * 2, k * 2, v, raw, beta))
    gate = type(gate)(gate.A_log.cuda(), gate.dt_bias.cuda(), gate.lower_bound)
    return (q, k, v, raw, beta), {"initial_state": h0.cuda(), "output_final_state": True, "cu_seqlens": cu.cuda(),
                                  "normalize_qk": True, "gate": gate}


@pytest.mark.parametrize("T", [4096, 65536, 262144])
@torch.no_grad()
def test_segmented_equals_fla_bf16(T):
    inputs, args = case(T, torch.bfloat16)
    ref = kda(*inputs, impl="fla", **args)
    chosen = auto_segments(T, 3, H, torch.device("cuda"))
    for segments in sorted({2, 8, 32, max(2, chosen)}):
        out = kda(*inputs, impl="segmented", segments=segments, **args)
        for name, r, o in zip(("o", "final state"), ref, out, strict=True):
            assert_rel_close(f"{name}, T={T}, S={segments}", r.float(), o.float(), BF16_TOL)


@torch.no_grad()
def test_segmented_fp32_equals_chunk():
    inputs, args = case(4096, torch.float32, seed=1)
    ref = kda(*inputs, impl="chunk", **args)
    out = kda(*inputs, impl="segmented", segments=8, **args)
    for name, r, o in zip(("o", "final state"), ref, out, strict=True):
        assert_rel_close(name, r, o, 1e-5)


@torch.no_grad()
def test_auto_follows_the_measured_rule():
    """No length measured faster on an H100 (bench.kda_segments): auto keeps fla's kernel, exactly."""
    inputs, args = case(65536, torch.bfloat16, seed=2)
    assert auto_segments(65536, 3, H, torch.device("cuda")) == auto_segments(1 << 20, 1, 12, torch.device("cuda")) == 1
    assert_rel_close("auto vs fla", kda(*inputs, impl="fla", **args)[0].float(), kda(*inputs, **args)[0].float(),
                     EXACT)
