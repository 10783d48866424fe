"""fla's Triton kernels (KDA, the short conv, the output norm-gate; CUDA only) against our torch
paths: same contract, same numbers within kernel precision; and the torch chunk path on CUDA in
fp32. `-m gpu`; skipped where CUDA or fla+triton is missing (all CPU machines).

fla's KDA kernels are checked as the product runs them: "auto" sends only half precision to fla
(fp32 stays on the torch paths, k3.ops.kda), so q, k, v go in as bf16, beta too (the layer sends
it in fp32; bf16 is the coarser of the two), the raw gate and the state in fp32, against the fp32
torch reference on the same bf16-rounded values (so the error measures the kernel, not input
rounding), within 1e-2; fp32 paths within 1e-4. Heads of 128 as in k3-1b and the serving benches:
the kernels compiled and autotuned here are those they use, not specializations nothing else
runs. Lengths include awkward ones: 1, 63, 64, 200, 672, 1000 (not a multiple of fla's 64-token
chunk)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.model.kda import KimiDeltaAttention
from k3.ops import fla_kernels
from k3.ops.conv import causal_conv1d
from k3.ops.kda import DecayGate, activate_gate, kda
from k3.ops.norm_gate import rms_norm_gated
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, EXACT, FP32_TOL
from tests.helpers.kda import clone_state, make_gate, make_inputs, make_layer, random_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_kernels.available(), reason="needs fla-core with triton")]
H, K = 8, 128
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL}
BF16_INPUTS = (0, 1, 2, 4)  # q, k, v, beta of (q, k, v, g, beta, h0): fla's activation dtype


def cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


def bf16_pair(tensors, half=BF16_INPUTS):
    """(fp32 reference leaves, fla leaves): the `half` positions rounded to bf16 for both, kept in
    bf16 for fla and upcast for the reference; every leaf requires grad."""
    rounded = [t.bfloat16() if i in half else t for i, t in enumerate(cuda(*tensors))]
    ref = [t.float().clone().requires_grad_() for t in rounded]
    out = [t.clone().requires_grad_() for t in rounded]
    return ref, out


def assert_close_all(names, refs, outs):
    for name, ref, out in zip(names, refs, outs, strict=True):
        assert_rel_close(name, ref.float(), out.float(), BF16_TOL)


def decode_pair(ref, out, extra=lambda leaves: {}):
    """Each sequence's first token as one decode step: the recurrence on the reference leaves, fla's
    decode kernel (fused_recurrent_kda) on its own; `extra(leaves)`: more kda arguments."""
    with torch.no_grad():
        return [kda(*(t[:, :1] for t in x[:5]), initial_state=x[5][:x[0].shape[0]], output_final_state=True,
                    impl=impl, **extra(x)) for impl, x in (("recurrent", ref), ("fla", out))]


CASES = [(2, 63, "lb"), (1, 200, "softplus"), (1, 64, "lb")]


@pytest.mark.parametrize("B,T,gate", CASES, ids=[f"B{b}-T{t}-{g}" for b, t, g in CASES])
def test_fla_chunk_matches_chunk_outputs_and_grads(B, T, gate):
    leaves = dict(zip(("chunk", "fla"), bf16_pair(make_inputs(B, T, H, K, K, gate))))
    do, ds = torch.randn(B, T, H, K, device="cuda"), torch.randn(B, H, K, K, device="cuda")
    results = {}
    for impl, inputs in leaves.items():
        o, s = kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, impl=impl)
        grads = torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), inputs)
        results[impl] = (o, s, *grads)
    assert_close_all(["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], results["chunk"], results["fla"])


def gated_kda_grads(impl: str, leaves: list[torch.Tensor], lower_bound: float | None, do, ds, cu_seqlens=None):
    """kda as the layer calls it, leaves = q, k, v, raw gate, beta, h0, A_log, dt_bias (the gate
    activated by the op: in fla's kernels for impl "fla"): o, final state and the gradients of
    every leaf, of <o, do> + <state, ds>."""
    o, s = kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu_seqlens, impl=impl,
               gate=DecayGate(*leaves[6:], lower_bound))
    return o, s, *torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), leaves)


GATED_NAMES = ["o", "final state", "dq", "dk", "dv", "draw", "dbeta", "dh0", "dA_log", "ddt_bias"]


def assert_gate_parameter_sums(raw: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                               draw: torch.Tensor, dA_log: torch.Tensor, ddt_bias: torch.Tensor):
    """A_log and dt_bias act on every token's gate, so their gradients are sums over tokens of the
    raw-gate gradient the path returned, times a known factor (z = raw + dt_bias; softplus gate:
    dA_log = sum draw * softplus(z) / sigmoid(z); bounded gate: dA_log = sum draw * z; both:
    ddt_bias = sum draw). Recomputed in fp64 from the path's own draw, they show whether the path
    adds error when it reduces, apart from the error it already has per token."""
    z = raw.detach().double() + dt_bias.detach().double().view(raw.shape[-2:])
    draw = draw.detach().double()
    factor = z if lower_bound is not None else F.softplus(z) / torch.sigmoid(z)
    assert_rel_close("dA_log = fp64 sum of its own draw", (draw * factor).sum((0, 1, 3)), dA_log, FP32_TOL)
    assert_rel_close("ddt_bias = fp64 sum of its own draw", draw.sum((0, 1)).flatten(), ddt_bias, FP32_TOL)


def gate_parameter_case(form: str, seed: int, B: int = 2, T: int = 1000):
    """One seed's inputs: (fp32 reference leaves, fla leaves) as bf16_pair makes them from q, k,
    v, raw gate, beta, h0, A_log, dt_bias; the gate's lower bound; random loss weights
    do [B, T, H, K] and ds [B, H, K, K]."""
    torch.manual_seed(seed)
    q, k, v, _, beta, h0 = make_inputs(B, T, H, K, K, form)
    raw, gate = make_gate(B, T, H, K, form)
    ref, out = bf16_pair((q, k, v, raw, beta, h0, gate.A_log, gate.dt_bias))
    do, ds = torch.randn(B, T, H, K, device="cuda"), torch.randn(B, H, K, K, device="cuda")
    return ref, out, gate.lower_bound, do, ds


@pytest.mark.parametrize("form", ["lb", "softplus"])
def test_fla_gate_parameter_gradient_over_seeds(form):
    """dA_log [H] sums the per-token gate gradient over every token and key of a head, terms of
    both signs that largely cancel, so one seed's RMSE ratio over 8 heads is a noisy statistic: the
    softplus gate's swings 5x over eight seeds (2.6e-3 .. 1.2e-2 on an H200, bench.kda_gate_precision),
    the spread coming from the size of the exact sums. Pooling the heads of 8 seeds measures the
    same ratio, RMSE(error) / RMSE(gradient), on 64 sums instead of 8."""
    refs, outs = [], []
    for seed in range(8):
        ref, out, lower_bound, do, ds = gate_parameter_case(form, seed)
        refs.append(gated_kda_grads("chunk", ref, lower_bound, do, ds)[-2])
        outs.append(gated_kda_grads("fla", out, lower_bound, do, ds)[-2])
    assert_rel_close("dA_log, 8 seeds pooled", torch.cat(refs), torch.cat(outs), BF16_TOL)


GATED_CASES = [(2, 1000, "lb", None), (2, 1000, "softplus", None), (1, 1000, "lb", (1, 63, 64, 200, 672))]
GATED_IDS = ["B2-T1000-lb", "B2-T1000-softplus", "packed-1-63-64-200-672-lb"]


@pytest.mark.parametrize("B,T,form,lengths", GATED_CASES, ids=GATED_IDS)
def test_fla_in_kernel_gate_matches_torch_gate(B, T, form, lengths):
    """The layer's CUDA path: raw gate projections activated inside fla's kernels (safe_gate for the
    bounded form) vs the torch chunk path activating them with `activate_gate`: outputs, state and
    every gradient (dA_log pooled over seeds in the test above); A_log's and dt_bias's gradients as
    fp64 sums of fla's own raw-gate gradient; then the decode kernel vs the recurrence."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    N = B if lengths is None else len(lengths)
    cu = None if lengths is None else torch.tensor([0, *lengths], device="cuda").cumsum(0)
    q, k, v, _, beta, h0 = make_inputs(B, T, H, K, K, "lb", N=N)
    raw, gate = make_gate(B, T, H, K, form)
    leaves = dict(zip(("chunk", "fla"), bf16_pair((q, k, v, raw, beta, h0, gate.A_log, gate.dt_bias))))
    ref = leaves["chunk"]
    oracle = (naive_kda_lowerbound_gate(ref[3], ref[6], ref[7], gate.lower_bound) if form == "lb"
              else naive_kda_gate(ref[3], ref[6], ref[7]))
    ours = activate_gate(ref[3], DecayGate(*ref[6:], gate.lower_bound))
    assert_rel_close("gate formula vs fla's oracle", oracle, ours, 1e-6)
    do, ds = torch.randn(B, T, H, K, device="cuda"), torch.randn(N, H, K, K, device="cuda")
    results = {impl: gated_kda_grads(impl, inputs, gate.lower_bound, do, ds, cu) for impl, inputs in leaves.items()}
    kept = [n for n, name in enumerate(GATED_NAMES) if name != "dA_log"]  # one seed's 8 sums: the test above
    assert_close_all([GATED_NAMES[n] for n in kept], [results["chunk"][n] for n in kept],
                     [results["fla"][n] for n in kept])
    fla, got = leaves["fla"], results["fla"]
    assert_gate_parameter_sums(fla[3], fla[7], gate.lower_bound, got[5], got[8], got[9])
    decoded = decode_pair(*leaves.values(), lambda x: {"gate": DecayGate(*x[6:], gate.lower_bound)})
    assert_close_all(["decode o", "decode state"], *decoded)  # with the gate in-kernel


def test_auto_fp32_on_cuda_matches_recurrence(B=2, T=1000):
    """fp32 through "auto" (the torch chunk path on CUDA: IEEE matmuls) against the token-by-token
    recurrence, a different algorithm, with the bounded gate activated by the op: outputs, state
    and every gradient, dA_log included, within 1e-4; A_log's and dt_bias's as sums of its draw."""
    q, k, v, _, beta, h0 = make_inputs(B, T, H, K, K, "lb")
    raw, gate = make_gate(B, T, H, K, "lb")
    inputs = cuda(q, k, v, raw, beta, h0, gate.A_log, gate.dt_bias)
    do, ds = torch.randn(B, T, H, K, device="cuda"), torch.randn(B, H, K, K, device="cuda")
    results = {impl: gated_kda_grads(impl, [t.clone().requires_grad_() for t in inputs], gate.lower_bound, do, ds)
               for impl in ("recurrent", "auto")}
    for name, ref, out in zip(GATED_NAMES, results["recurrent"], results["auto"], strict=True):
        assert_rel_close(name, ref, out, FP32_TOL)
    got = results["auto"]
    assert_gate_parameter_sums(inputs[3], inputs[7], gate.lower_bound, got[5], got[8], got[9])


def test_fla_packed_and_decode_match_reference():
    lengths = [5, 70, 1, 33]
    ref, out = bf16_pair(make_inputs(1, sum(lengths), H, K, K, "lb", N=len(lengths)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    with torch.no_grad():
        packed = [kda(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=cu, impl=impl)
                  for impl, x in (("chunk", ref), ("fla", out))]
    assert_close_all(["packed o", "packed state"], *packed)
    assert_close_all(["decode o", "decode state"], *decode_pair(ref, out))


def test_fla_layer_matches_chunk_layer_with_state():
    """The layer under bf16 autocast, fla's kernels vs the torch chunk path under the same autocast.
    Bound 3e-2: the two paths round the layer's bf16 activations at different points (fla after its
    fused conv, gate and norms); tests/model/test_gpu_layers.py bounds the layer against the fp32
    reference by what bf16 costs the torch path itself."""
    ref = make_layer("lb", kda_impl="chunk").cuda()
    fla = make_layer("lb", kda_impl="fla").cuda()
    fla.load_state_dict(ref.state_dict())
    x = torch.randn(2, 50, ref.config.hidden_size, device="cuda")
    s_ref = random_state(ref.config, 2)
    s_ref.conv, s_ref.recurrent = s_ref.conv.cuda(), s_ref.recurrent.cuda()
    s_fla = clone_state(s_ref)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = ref(x, state=s_ref)
        y = fla(x, state=s_fla)
    assert_rel_close("y", y_ref.float(), y.float(), 3e-2)
    assert_rel_close("state", s_ref.recurrent, s_fla.recurrent, 3e-2)
    assert_rel_close("conv tails", s_ref.conv.float(), s_fla.conv.float(), 3e-2)


def prefix_inputs(T: int, i: int):
    """Two sets of op inputs (q, k, v in bf16, raw gate fp32, beta bf16; no state) equal before
    position i and independently random from i on."""
    def one_set():
        q, k, v, _, beta, _ = make_inputs(1, T, H, K, K, "lb", with_state=False)
        return [q, k, v, make_gate(1, T, H, K, "lb")[0], beta]
    first, other = one_set(), one_set()
    second = [torch.cat([a[:, :i], b[:, i:]], dim=1) for a, b in zip(first, other)]
    return [[t.to("cuda", torch.float32 if j == 3 else torch.bfloat16) for j, t in enumerate(s)]
            for s in (first, second)]


def test_fla_prefix_invariance(T=1000, i=437):
    """fla issue #1240: with its in-kernel safe gate, fla's sub-chunk anchor could lie in the
    future, so prefix outputs depended on later gates. The op as the layer calls it (K3's bounded
    gate activated in-kernel with safe_gate), every input changed from position i on (i inside a
    16-token sub-chunk, where that anchor row lies in the future): outputs before i, and the
    gradients of a loss that reads only outputs before i, must not move; gradients from i on must
    be 0; the first i tokens alone must give the same outputs (appending is invisible)."""
    gate = make_gate(1, 1, H, K, "lb")[1]
    gate = DecayGate(gate.A_log.cuda(), gate.dt_bias.cuda(), gate.lower_bound)

    def op(q, k, v, raw, beta):
        return kda(q, k, v, raw, beta, impl="fla", gate=gate)[0]

    do = torch.randn(1, i, H, K, device="cuda")
    input_sets = prefix_inputs(T, i)
    runs = []
    for inputs in input_sets:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        o = op(*leaves)
        runs.append((o, torch.autograd.grad((o[:, :i].float() * do).sum(), leaves)))
    (o1, g1), (o2, g2) = runs
    assert_rel_close("outputs before i", o1[:, :i].float(), o2[:, :i].float(), EXACT)
    with torch.no_grad():
        alone = op(*[t[:, :i] for t in input_sets[0]])
    assert_rel_close("first i tokens alone", o1[:, :i].float(), alone.float(), EXACT)
    for name, a, b in zip(("dq", "dk", "dv", "draw", "dbeta"), g1, g2, strict=True):
        assert_rel_close(f"{name} before i", a[:, :i].float(), b[:, :i].float(), EXACT)
        rms = [part.float().pow(2).mean().sqrt() for part in (a[:, i:], a[:, :i])]
        leak = (rms[0] / rms[1].clamp_min(1e-30)).item()
        assert leak <= EXACT, f"{name} from i on: rms {leak:.3e} of the rms before i (want 0)"


def test_fla_layer_prefix_invariance():
    """The same at the layer: its fla path (conv, gate in-kernel, norm-gate), outputs before i."""
    layer: KimiDeltaAttention = make_layer("lb", kda_impl="fla").cuda()
    i, T = 37, 150
    x = torch.randn(1, T, layer.config.hidden_size, device="cuda")
    x2 = x.clone()
    x2[:, i:] += 3 * torch.randn_like(x2[:, i:])
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert_rel_close("outputs before i", layer(x)[:, :i].float(), layer(x2)[:, :i].float(), EXACT)


def test_fla_normalize_qk_in_kernel_matches_chunk():
    """q/k L2 norm inside fla's kernels (chunk with grads, and decode) vs the torch path's."""
    q, k, v, g, beta, h0 = make_inputs(2, 70, H, K, K, "lb")
    q, k = 3 * q + 0.1 * torch.randn_like(q), k + 0.1 * torch.randn_like(k)
    leaves = dict(zip(("chunk", "fla"), bf16_pair((q, k, v, g, beta, h0))))
    do = torch.randn(2, 70, H, K, device="cuda")
    results = {}
    for impl, x in leaves.items():
        o, s = kda(*x[:5], initial_state=x[5], output_final_state=True, impl=impl, normalize_qk=True)
        results[impl] = (o, s, *torch.autograd.grad((o.float() * do).sum(), x[:2]))
    assert_close_all(("o", "state", "dq", "dk"), results["chunk"], results["fla"])
    assert_close_all(["decode o", "decode state"], *decode_pair(*leaves.values(), lambda x: {"normalize_qk": True}))


def test_auto_keeps_fp32_on_torch_paths():
    """fla for half precision only: fp32 on CUDA runs the torch chunk path (IEEE matmuls)."""
    q, k, v, g, beta, h0 = cuda(*make_inputs(1, 40, H, K, K, "lb"))
    assert torch.equal(kda(q, k, v, g, beta, initial_state=h0)[0],
                       kda(q, k, v, g, beta, initial_state=h0, impl="chunk")[0])
    vb = v.bfloat16()
    assert torch.equal(kda(q, k, vb, g, beta, initial_state=h0)[0],
                       kda(q, k, vb, g, beta, initial_state=h0, impl="fla")[0])


DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
CONV_CASES = [(96, (1, 3, 70, 64)), (3 * H * K, (1, 3, 700, 64, 4000))]  # the second: the KDA layer's q|k|v width


@pytest.mark.parametrize("C,lengths", CONV_CASES, ids=[f"C{c}-packed-{'-'.join(map(str, n))}" for c, n in CONV_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fla_conv_matches_torch_conv_packed_with_tails(dtype, C, lengths, W=4):
    """fla's causal conv (SiLU fused) in `dtype` vs the torch reference in fp32 on the same values
    upcast: packed sequences (one shorter than the kernel) with initial tails; outputs, final tails
    and the gradients of x, the weight and the initial tails, through outputs and tails."""
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    inputs = [torch.randn(1, sum(lengths), C, device="cuda"), torch.randn(C, W, device="cuda") / W,
              torch.randn(len(lengths), C, W - 1, device="cuda")]
    inputs = [t.to(dtype) for t in inputs]  # rounded once: the reference sees the same values
    dy, dtail = torch.randn(1, sum(lengths), C, device="cuda"), torch.randn(len(lengths), C, W - 1, device="cuda")
    results = {}
    for impl, run_dtype in (("torch", torch.float32), ("fla", dtype)):
        leaves = [t.detach().to(run_dtype).requires_grad_() for t in inputs]
        y, tails = causal_conv1d(*leaves[:2], initial_state=leaves[2], cu_seqlens=cu, output_final_state=True,
                                 activation="silu", impl=impl)
        grads = torch.autograd.grad((y.float() * dy).sum() + (tails.float() * dtail).sum(), leaves)
        results[impl] = (y, tails, *grads)
    assert results["fla"][0].dtype == dtype
    for name, ref, out in zip(("y", "tails", "dx", "dweight", "dh0"), results["torch"], results["fla"], strict=True):
        assert_rel_close(name, ref, out.float(), TOL[dtype])


NORM_GATE_SHAPES = [(2, 70, 3, 64), (2, 3000, H, K)]


@pytest.mark.parametrize("shape", NORM_GATE_SHAPES, ids=[f"B{b}-T{t}-H{h}-K{k}" for b, t, h, k in NORM_GATE_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fla_norm_gate_matches_torch(dtype, shape):
    """KDA's output norm-gate, fla's kernel in `dtype` (the weight fp32, as the layer holds it) vs
    the torch reference in fp32 on the same values upcast: outputs and the gradients of o, gate and
    weight."""
    inputs = [torch.randn(shape, device="cuda").to(dtype), torch.randn(shape, device="cuda").to(dtype),
              0.5 + torch.rand(shape[-1], device="cuda")]
    dy = torch.randn(shape, device="cuda")
    out = {}
    for impl, run_dtype in (("torch", torch.float32), ("fla", dtype)):
        leaves = [t.detach().to(run_dtype if n < 2 else torch.float32).requires_grad_() for n, t in enumerate(inputs)]
        y = rms_norm_gated(*leaves, eps=1e-5, impl=impl)
        out[impl] = (y, *torch.autograd.grad((y.float() * dy).sum(), leaves))
    assert out["fla"][0].dtype == dtype
    for name, ref, got in zip(("y", "do", "dgate", "dweight"), out["torch"], out["fla"], strict=True):
        assert_rel_close(name, ref, got.float(), TOL[dtype])
