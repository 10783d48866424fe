"""fla's Triton KDA kernels (CUDA only) against our chunk/recurrent paths: same contract, same
numbers within kernel precision. Skipped where CUDA or fla+triton is missing (all CPU machines)."""
from __future__ import annotations

import pytest
import torch

from k3.model.kda import KimiDeltaAttention
from k3.ops import fla_kernels
from k3.ops.conv import causal_conv1d
from k3.ops.norm_gate import rms_norm_gated
from k3.ops.kda import DecayGate, activate_gate, kda
from tests.conftest import assert_rel_close
from tests.test_kda_layer import make_layer, random_state, clone_state
from tests.test_kda_ops import make_gate, make_inputs

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and fla_kernels.available()),
                                reason="needs CUDA and fla-core with triton")
# fla's kernels accumulate in fp32 but may round operands (tf32/bf16 tensor cores): looser than 1e-5.
FLA_TOL = 5e-3


def cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


CASES = [(2, 63, 2, 64, "lb"), (1, 200, 4, 128, "softplus"), (1, 64, 2, 64, "lb")]


@pytest.mark.parametrize("B,T,H,K,gate", CASES, ids=[f"B{b}-T{t}-H{h}-K{k}-{g}" for b, t, h, k, g in CASES])
def test_fla_chunk_matches_chunk_outputs_and_grads(B, T, H, K, gate):
    inputs = [t.requires_grad_() for t in cuda(*make_inputs(B, T, H, K, K, gate))]
    do, ds = torch.randn(B, T, H, K, device="cuda"), torch.randn(B, H, K, K, device="cuda")
    results = {}
    for impl in ("chunk", "fla"):
        o, s = kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, impl=impl)
        grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), inputs)
        results[impl] = (o, s, grads)
    assert_rel_close("o", results["chunk"][0], results["fla"][0], FLA_TOL)
    assert_rel_close("final state", results["chunk"][1], results["fla"][1], FLA_TOL)
    for name, ref, out in zip(["q", "k", "v", "g", "beta", "h0"], results["chunk"][2], results["fla"][2]):
        assert_rel_close(f"d{name}", ref, out, FLA_TOL)


@pytest.mark.parametrize("form", ["lb", "softplus"])
def test_fla_in_kernel_gate_matches_torch_gate(form):
    """The layer's CUDA path: raw gate projections activated inside fla's kernels (safe_gate for the
    bounded form) vs the torch chunk path activating them with `activate_gate`: outputs, state and
    every gradient (A_log and dt_bias included); then the decode kernel vs the recurrence."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    B, T, H, K = 2, 150, 2, 64
    q, k, v, _, beta, h0 = cuda(*make_inputs(B, T, H, K, K, "lb"))
    raw, gate = make_gate(B, T, H, K, form)
    leaves = [t.requires_grad_() for t in (q, k, v, *cuda(raw), beta, h0, *cuda(gate.A_log, gate.dt_bias))]
    oracle = (naive_kda_lowerbound_gate(leaves[3], leaves[6], leaves[7], gate.lower_bound) if form == "lb"
              else naive_kda_gate(leaves[3], leaves[6], leaves[7]))
    assert_rel_close("gate formula vs fla's oracle", oracle, activate_gate(leaves[3], DecayGate(*leaves[6:], gate.lower_bound)), 1e-6)
    do, ds = torch.randn(B, T, H, K, device="cuda"), torch.randn(B, H, K, K, device="cuda")
    results = {}
    for impl in ("chunk", "fla"):
        o, s = kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, impl=impl,
                   gate=DecayGate(*leaves[6:], gate.lower_bound))
        results[impl] = (o, s, torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves))
    assert_rel_close("o", results["chunk"][0], results["fla"][0], FLA_TOL)
    assert_rel_close("final state", results["chunk"][1], results["fla"][1], FLA_TOL)
    for name, ref, out in zip(["q", "k", "v", "raw", "beta", "h0", "A_log", "dt_bias"], results["chunk"][2], results["fla"][2]):
        assert_rel_close(f"d{name}", ref, out, FLA_TOL)
    with torch.no_grad():  # decode: fused_recurrent_kda with the gate in-kernel
        one = [t[:, :1] for t in leaves[:5]]
        decoded = {impl: kda(*one, initial_state=h0, output_final_state=True, impl=impl,
                             gate=DecayGate(*leaves[6:], gate.lower_bound)) for impl in ("recurrent", "fla")}
    assert_rel_close("decode o", decoded["recurrent"][0], decoded["fla"][0], FLA_TOL)
    assert_rel_close("decode state", decoded["recurrent"][1], decoded["fla"][1], FLA_TOL)


def test_fla_packed_and_decode_match_reference():
    lengths = [5, 70, 1, 33]
    N, H, K = len(lengths), 2, 64
    q, k, v, g, beta, h0 = cuda(*make_inputs(1, sum(lengths), H, K, K, "lb", N=N))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    o_ref, s_ref = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl="chunk")
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl="fla")
    assert_rel_close("packed o", o_ref, o, FLA_TOL)
    assert_rel_close("packed state", s_ref, s, FLA_TOL)
    one = [t[:, :1] for t in (q, k, v, g, beta)]  # decode: fused_recurrent_kda (no grad)
    with torch.no_grad():
        o_ref, s_ref = kda(*one, initial_state=h0[:1], output_final_state=True, impl="recurrent")
        o, s = kda(*one, initial_state=h0[:1], output_final_state=True, impl="fla")
    assert_rel_close("decode o", o_ref, o, FLA_TOL)
    assert_rel_close("decode state", s_ref, s, FLA_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_layer_matches_chunk_layer_with_state(dtype):
    ref = make_layer("lb", kda_impl="chunk").cuda()
    fla = make_layer("lb", kda_impl="fla").cuda()
    fla.load_state_dict(ref.state_dict())
    x = torch.randn(2, 50, ref.config.hidden_size, device="cuda")
    s_ref = random_state(ref.config, 2)
    s_ref.conv, s_ref.recurrent = s_ref.conv.cuda(), s_ref.recurrent.cuda()
    s_fla = clone_state(s_ref)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        y_ref = ref(x, state=s_ref)
        y = fla(x, state=s_fla)
    tol = FLA_TOL if dtype == torch.float32 else 3e-2
    assert_rel_close("y", y_ref.float(), y.float(), tol)
    assert_rel_close("state", s_ref.recurrent, s_fla.recurrent, tol)


def test_fla_prefix_invariance():
    """fla issue #1240: with its in-kernel safe gate, prefix outputs could depend on later gates.
    The layer's fla path activates K3's bounded gate in-kernel with safe_gate: the prefix must not move."""
    layer: KimiDeltaAttention = make_layer("lb", kda_impl="fla").cuda()
    i, T = 37, 150
    x = torch.randn(1, T, layer.config.hidden_size, device="cuda")
    x2 = x.clone()
    x2[:, i:] += 3 * torch.randn_like(x2[:, i:])
    with torch.no_grad():
        assert_rel_close("outputs before i", layer(x)[:, :i], layer(x2)[:, :i], 1e-6)


def test_fla_normalize_qk_in_kernel_matches_chunk():
    """q/k L2 norm inside fla's kernels (chunk with grads, and decode) vs the torch path's."""
    q, k, v, g, beta, h0 = cuda(*make_inputs(2, 70, 2, 64, 64, "lb"))
    q, k = (3 * q + 0.1 * torch.randn_like(q)).requires_grad_(), (k + 0.1 * torch.randn_like(k)).requires_grad_()
    do = torch.randn_like(v)
    results = {}
    for impl in ("chunk", "fla"):
        o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl=impl, normalize_qk=True)
        results[impl] = (o, s, *torch.autograd.grad((o * do).sum(), (q, k)))
    for name, ref, out in zip(("o", "state", "dq", "dk"), results["chunk"], results["fla"]):
        assert_rel_close(name, ref, out, FLA_TOL)
    with torch.no_grad():
        one = [t[:, :1] for t in (q, k, v, g, beta)]
        ref = kda(*one, initial_state=h0, output_final_state=True, impl="recurrent", normalize_qk=True)
        out = kda(*one, initial_state=h0, output_final_state=True, impl="fla", normalize_qk=True)
    assert_rel_close("decode o", ref[0], out[0], FLA_TOL)
    assert_rel_close("decode state", ref[1], out[1], FLA_TOL)


def test_auto_keeps_fp32_on_torch_paths():
    """fla for half precision only: fp32 on CUDA runs the torch chunk path (IEEE matmuls)."""
    q, k, v, g, beta, h0 = cuda(*make_inputs(1, 40, 2, 64, 64, "lb"))
    assert torch.equal(kda(q, k, v, g, beta, initial_state=h0)[0],
                       kda(q, k, v, g, beta, initial_state=h0, impl="chunk")[0])
    vb = v.bfloat16()
    assert torch.equal(kda(q, k, vb, g, beta, initial_state=h0)[0],
                       kda(q, k, vb, g, beta, initial_state=h0, impl="fla")[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_conv_matches_torch_conv_packed_with_tails(dtype):
    """fla's causal conv (SiLU fused) vs the torch reference in fp32: outputs, final tails and the
    gradients of x, the weight and the initial tails, through outputs and tails."""
    lengths, C, W = [1, 3, 70, 64], 96, 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    x = torch.randn(1, sum(lengths), C, device="cuda")
    weight, h0 = torch.randn(C, W, device="cuda") / 2, torch.randn(len(lengths), C, W - 1, device="cuda")
    dy, dtail = torch.randn_like(x), torch.randn_like(h0)
    results = {}
    for impl in ("torch", "fla"):
        leaves = [t.detach().clone().to(dtype if impl == "fla" else torch.float32).requires_grad_()
                  for t in (x, weight, h0)]
        y, tails = causal_conv1d(*leaves[:2], initial_state=leaves[2], cu_seqlens=cu, output_final_state=True,
                                 activation="silu", impl=impl)
        grads = torch.autograd.grad((y.float() * dy).sum() + (tails.float() * dtail).sum(), leaves)
        results[impl] = (y, tails, *grads)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, ref, out in zip(("y", "tails", "dx", "dweight", "dh0"), results["torch"], results["fla"]):
        assert_rel_close(name, ref.float(), out.float(), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_norm_gate_matches_torch(dtype):
    o, gate = (torch.randn(2, 70, 3, 64, device="cuda", dtype=dtype) for _ in range(2))
    weight = 0.5 + torch.rand(64, device="cuda")
    leaves = {impl: [t.detach().clone().requires_grad_() for t in (o, gate, weight)] for impl in ("torch", "fla")}
    dy = torch.randn(2, 70, 3, 64, device="cuda")
    out = {}
    for impl, ts in leaves.items():
        y = rms_norm_gated(*ts, eps=1e-5, impl=impl)
        out[impl] = (y, *torch.autograd.grad((y.float() * dy).sum(), ts))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, ref, got in zip(("y", "do", "dgate", "dweight"), out["torch"], out["fla"]):
        assert got.dtype == ref.dtype
        assert_rel_close(name, ref.float(), got.float(), tol)
