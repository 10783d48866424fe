"""KDA ops: reference and chunk vs fla's pure-torch oracles, chunk vs recurrent (outputs, final
states, every gradient), packed sequences, the causal conv, and the dispatch contract."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3.ops.conv import causal_conv1d
from k3.ops.kda import activate_gate, kda, kda_chunk, kda_recurrent
from k3.ops.kda.inputs import l2_normalize
from tests.helpers import assert_rel_close
from tests.helpers.kda import make_gate, make_inputs

TOL = 1e-5


@pytest.fixture(scope="module")
def fla_naive():
    """fla's naive KDA oracles, loaded by file path: `import fla` would need triton."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla-core is not installed (test extra)")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def ids(B, T, H, K, gate, *extra):
    return "-".join([f"B{B}", f"T{T}", f"H{H}", f"K{K}", gate, *map(str, extra)])


RECURRENT_CASES = [(2, 63, 2, 16, "lb"), (1, 100, 2, 16, "softplus"), (2, 1, 2, 16, "lb"), (1, 64, 1, 32, "softplus")]


@pytest.mark.parametrize("B,T,H,K,gate", RECURRENT_CASES, ids=[ids(*c) for c in RECURRENT_CASES])
def test_recurrent_matches_fla_naive(fla_naive, B, T, H, K, gate):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, K, gate)
    o_ref, s_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_rel_close("o", o_ref, o, TOL)
    assert_rel_close("final state", s_ref, s, TOL)
    assert s.dtype == torch.float32


CHUNK_CASES = [(2, 64, 2, 16, "lb", 16), (1, 128, 2, 16, "softplus", 64), (1, 128, 2, 32, "lb", 64),
               (2, 64, 1, 16, "softplus", 16)]


@pytest.mark.parametrize("B,T,H,K,gate,C", CHUNK_CASES, ids=[ids(*c[:5], f"C{c[5]}") for c in CHUNK_CASES])
def test_chunk_matches_fla_naive_chunk(fla_naive, B, T, H, K, gate, C):
    """fla's naive_chunk_kda needs T % chunk == 0, so only multiples are compared with it."""
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, K, gate)
    o_ref, s_ref = fla_naive.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             chunk_size=C)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    assert_rel_close("o", o_ref, o, TOL)
    assert_rel_close("final state", s_ref, s, TOL)


ANY_T_CASES = [(2, 63, 2, 16, "lb", 16), (1, 100, 2, 16, "softplus", 64), (1, 37, 2, 16, "lb", 32),
               (2, 5, 1, 16, "softplus", 64), (1, 130, 1, 16, "lb", 64)]


@pytest.mark.parametrize("B,T,H,K,gate,C", ANY_T_CASES, ids=[ids(*c[:5], f"C{c[5]}") for c in ANY_T_CASES])
def test_chunk_matches_fla_naive_recurrent_any_length(fla_naive, B, T, H, K, gate, C):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, K, gate)
    o_ref, s_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    assert_rel_close("o", o_ref, o, TOL)
    assert_rel_close("final state", s_ref, s, TOL)


GRAD_CASES = [(2, 45, 2, 16, "lb", 16), (1, 40, 2, 16, "softplus", 32)]


@pytest.mark.parametrize("B,T,H,K,gate,C", GRAD_CASES, ids=[ids(*c[:5], f"C{c[5]}") for c in GRAD_CASES])
def test_chunk_gradients_match_recurrent(B, T, H, K, gate, C):
    inputs = [t.requires_grad_() for t in make_inputs(B, T, H, K, K, gate)]
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    do, ds = torch.randn(B, T, H, K), torch.randn(B, H, K, K)
    grads = {}
    for impl in ("recurrent", "chunk"):
        o, s = kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, impl=impl, chunk_size=C)
        grads[impl] = torch.autograd.grad((o * do).sum() + (s * ds).sum(), inputs)
    for name, ref, out in zip(names, grads["recurrent"], grads["chunk"]):
        assert_rel_close(f"d{name}", ref, out, TOL)


@pytest.mark.parametrize("C", [16, 64], ids=["C16", "C64"])
def test_chunk_gradients_finite_under_extreme_decay(C):
    """No exp of a positive argument anywhere (non-causal decays are -inf before exp, cross-block
    decays factor through the block end): a -1e3 log-decay must not produce NaN/inf grads."""
    q, k, v, _, beta, h0 = make_inputs(1, 100, 2, 16, 16, "lb")
    g = torch.full_like(q, -1000.0).requires_grad_()
    q.requires_grad_()
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(g.grad).all() and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_packed_sequences_equal_separate_runs(impl):
    lengths = [5, 40, 1, 17]
    N, H, K = len(lengths), 2, 16
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), H, K, K, "lb", N=N)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl=impl,
               chunk_size=16)
    for n in range(N):
        span = slice(cu[n].item(), cu[n + 1].item())
        o_n, s_n = kda_recurrent(q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span],
                                 initial_state=h0[n:n + 1], output_final_state=True)
        assert_rel_close(f"o[seq {n}]", o_n, o[:, span], TOL)
        assert_rel_close(f"state[seq {n}]", s_n, s[n:n + 1], TOL)


@pytest.mark.parametrize("with_state", [True, False])
def test_packed_decode_rows_equal_padded_chunk_with_gradients(with_state):
    """A serving step's shape (decode and speculative rows around prefill chunks): the split path
    (k3/ops/kda/decode_rows.py) equals kda_chunk over the whole padded batch, outputs, final states
    and the gradients of every input."""
    lengths = [1, 1, 30, 1, 7, 5, 16, 17]  # short rows (<= 16: the recurrent batch) around chunked ones
    N, H, K = len(lengths), 2, 16
    inputs = make_inputs(1, sum(lengths), H, K, K, "softplus", with_state=with_state, N=N)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    results = []
    for run in (kda_chunk, lambda *a, **kw: kda(*a, **kw, impl="chunk")):
        leaves = [t.clone().requires_grad_() for t in inputs if t is not None]
        o, s = run(*leaves[:5], initial_state=leaves[5] if with_state else None, output_final_state=True,
                   cu_seqlens=cu, chunk_size=16)
        grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + s.square().sum(), leaves)
        results.append((o, s, grads))
    (o_ref, s_ref, g_ref), (o, s, g) = results
    assert_rel_close("o", o_ref, o, TOL)
    assert_rel_close("state", s_ref, s, TOL)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], g_ref, g):
        assert_rel_close(f"d{name}", a, b, TOL)


def test_kda_output_dtype_and_state_dtype():
    q, k, v, g, beta, h0 = make_inputs(1, 20, 2, 16, 16, "lb")
    o, s = kda(q, k, v.to(torch.bfloat16), g, beta, initial_state=h0, output_final_state=True, impl="chunk")
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o, s = kda(q, k, v, g, beta, impl="chunk")
    assert s is None


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_normalize_qk_equals_normalizing_first(impl):
    q, k, v, g, beta, h0 = make_inputs(2, 9, 2, 16, 16, "lb")
    raw_q, raw_k = 3 * q + 0.1 * torch.randn_like(q), 0.5 * k + 0.1 * torch.randn_like(k)
    o_ref, s_ref = kda(l2_normalize(raw_q), l2_normalize(raw_k), v, g, beta, initial_state=h0,
                       output_final_state=True, impl=impl)
    o, s = kda(raw_q, raw_k, v, g, beta, initial_state=h0, output_final_state=True, impl=impl, normalize_qk=True)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_dispatch_auto_on_cpu_and_errors(caplog):
    q, k, v, g, beta, h0 = make_inputs(1, 9, 2, 16, 16, "lb")
    with caplog.at_level(logging.INFO, logger="k3.ops.kda"):
        o_auto, _ = kda(q, k, v, g, beta, initial_state=h0)
    o_chunk, _ = kda(q, k, v, g, beta, initial_state=h0, impl="chunk")
    assert torch.equal(o_auto, o_chunk)  # auto on CPU, T > 1: the chunk path
    o_auto1, _ = kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h0)
    o_rec1, _ = kda_recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h0)
    assert torch.equal(o_auto1, o_rec1)  # auto on CPU, T == 1: the recurrent path
    with pytest.raises(ValueError, match="impl"):
        kda(q, k, v, g, beta, impl="triton")
    with pytest.raises((ValueError, RuntimeError), match="fla"):
        kda(q, k, v, g, beta, impl="fla")
    with pytest.raises(ValueError, match="chunk_size"):
        kda(q, k, v, g, beta, impl="chunk", chunk_size=48)
    with pytest.raises(ValueError, match="initial_state"):
        kda(q, k, v, g, beta, initial_state=h0[:, :1])
    with pytest.raises(ValueError, match="beta"):
        kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="batch size 1"):
        kda(*(torch.cat([t, t]) for t in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="end at T"):
        kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 8]))


# ----------------------------------------------------------------------------- causal conv
def conv_oracle(x, weight):
    """nn.Conv1d semantics with left padding W-1, truncated to T (transformers' causal_conv1d_fn)."""
    T, C, W = x.shape[1], x.shape[2], weight.shape[1]
    return F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=W - 1, groups=C)[..., :T].transpose(1, 2)


@pytest.mark.parametrize("B,T,C,W", [(2, 17, 8, 4), (1, 2, 8, 4), (3, 5, 6, 1)],
                         ids=["B2-T17-C8-W4", "B1-T2-C8-W4", "B3-T5-C6-W1"])
def test_conv_matches_conv1d_and_tails(B, T, C, W):
    x, weight = torch.randn(B, T, C), torch.randn(C, W)
    y, tail = causal_conv1d(x, weight, output_final_state=True)
    assert_rel_close("y", conv_oracle(x, weight), y, 1e-6)
    padded = torch.cat([torch.zeros(B, W - 1, C), x], dim=1)  # tails are the last W-1 inputs, zero-filled
    assert torch.equal(tail, padded[:, padded.shape[1] - (W - 1):].transpose(1, 2))
    y_silu, _ = causal_conv1d(x, weight, activation="silu")
    assert_rel_close("silu(y)", F.silu(conv_oracle(x, weight)), y_silu, 1e-6)


@pytest.mark.parametrize("split", [1, 2, 3, 10], ids=lambda s: f"split{s}")
def test_conv_split_with_carried_tail_equals_one_pass(split):
    B, T, C, W = 2, 12, 8, 4
    x, weight, h0 = torch.randn(B, T, C), torch.randn(C, W), torch.randn(B, C, W - 1)
    y, tail = causal_conv1d(x, weight, initial_state=h0, output_final_state=True)
    y1, t1 = causal_conv1d(x[:, :split], weight, initial_state=h0, output_final_state=True)
    y2, t2 = causal_conv1d(x[:, split:], weight, initial_state=t1, output_final_state=True)
    assert_rel_close("y", y, torch.cat([y1, y2], 1), 1e-6)
    assert torch.equal(tail, t2)


def test_conv_packed_equals_separate_runs_and_gradcheck():
    lengths, C, W = [2, 5, 1, 3], 3, 4
    x = torch.randn(1, sum(lengths), C, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(C, W, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(len(lengths), C, W - 1, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y, tails = causal_conv1d(x, weight, initial_state=h0, cu_seqlens=cu, output_final_state=True)
    for n in range(len(lengths)):
        span = slice(cu[n].item(), cu[n + 1].item())
        y_n, t_n = causal_conv1d(x[:, span], weight, initial_state=h0[n:n + 1], output_final_state=True)
        assert_rel_close(f"y[seq {n}]", y_n, y[:, span], 1e-12)
        assert torch.equal(t_n, tails[n:n + 1])

    def packed(x, weight, h0):
        return causal_conv1d(x, weight, initial_state=h0, cu_seqlens=cu, output_final_state=True)

    assert torch.autograd.gradcheck(packed, (x, weight, h0), fast_mode=True)


def test_conv_errors():
    x, weight = torch.randn(1, 5, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(7, 4))
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, weight, initial_state=torch.randn(1, 8, 4))
    with pytest.raises(ValueError, match="non-decreasing"):
        causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 4, 2, 5]))
    with pytest.raises(ValueError, match="impl"):
        causal_conv1d(x, weight, impl="cudnn")
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, activation="gelu")
    with pytest.raises((ValueError, RuntimeError), match="fla"):
        causal_conv1d(x, weight, impl="fla")  # CUDA only


@pytest.mark.parametrize("form", ["lb", "softplus"])
@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_gate_argument_activates_the_raw_gate(impl, form):
    """kda(..., raw, gate=G) is kda(..., activate_gate(raw, G)) on the torch paths, gradients reaching
    A_log and dt_bias (fla's in-kernel gate is checked against the same on CUDA)."""
    q, k, v, _, beta, h0 = make_inputs(1, 37, 2, 16, 16, "lb")
    raw, gate = make_gate(1, 37, 2, 16, form)
    A_log, dt_bias = gate.A_log.requires_grad_(), gate.dt_bias.requires_grad_()
    o, s = kda(q, k, v, raw, beta, initial_state=h0, output_final_state=True, impl=impl, gate=gate)
    o_ref, s_ref = kda(q, k, v, activate_gate(raw, gate), beta, initial_state=h0, output_final_state=True, impl=impl)
    if impl == "chunk" and form == "lb":  # the known bound lets the chunk path factor its diagonal blocks
        assert_rel_close("o", o_ref, o, TOL)
        assert_rel_close("final state", s_ref, s, TOL)
    else:
        assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    grads = torch.autograd.grad(o.sum() + s.sum(), (A_log, dt_bias))
    assert all(g.isfinite().all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("extreme", [False, True])
def test_factored_diagonal_blocks_match_pairwise_decays(extreme):
    """Under a lower-bounded gate the chunk path's diagonal blocks are matmuls of rows decayed to and
    from the block's first token; they equal the explicit pairwise decays (values and gradients),
    also with every g at the bound, where a factor reaches e^((d - 1)|lb|)."""
    from k3.ops.kda.chunk import MAX_FACTOR_EXP, _intra_chunk_scores, factored_diag

    assert factored_diag(64, None) is None and factored_diag(64, -5.0) == 16
    assert factored_diag(64, -1.0) == 64 and factored_diag(64, -20.0) is None  # 7 * 20 > 80
    torch.manual_seed(0)
    q, k = (F.normalize(torch.randn(2, 3, 2, 64, 16, dtype=torch.float64), dim=-1) for _ in range(2))
    g = torch.full_like(q, -5.0) if extreme else -5.0 * torch.sigmoid(3 * torch.randn_like(q))
    G = g.cumsum(-2)
    d = factored_diag(64, -5.0)
    assert (d - 1) * 5.0 <= MAX_FACTOR_EXP
    ref = [t.requires_grad_() for t in (q.clone(), k.clone(), G.clone())]
    new = [t.float().requires_grad_() for t in (q, k, G)]
    out_ref, out = _intra_chunk_scores(*ref), _intra_chunk_scores(*new, d)
    w = [torch.randn_like(t) for t in out_ref]  # a random cotangent, not a sum
    sum((a * b).sum() for a, b in zip(out_ref, w)).backward()
    sum((a * b.float()).sum() for a, b in zip(out, w)).backward()
    for name, a, b in zip(("A_qk", "A_kk"), out_ref, out):
        assert b.isfinite().all()
        assert_rel_close(name, a, b, TOL)
    # every g at the bound: dG's largest entries cancel terms of both factors (the pairwise path's
    # own error there is ~8e-6, the factored one's ~3e-5; with gates inside the bound both ~4e-6)
    for name, a, b in zip(("dq", "dk", "dG"), ref, new):
        assert b.grad.isfinite().all()
        assert_rel_close(name, a.grad, b.grad, 1e-4 if extreme and name == "dG" else TOL)
