"""KimiDeltaAttention layer: official names/shapes, parity with transformers' Kimi-Linear layer,
both gates, chunk = recurrent, split prefill/decode = one pass, packed = separate runs, prefix
invariance of outputs and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.model.cache import KDAState
from k3.model.kda import KimiDeltaAttention
from k3.ops.kda import activate_gate
from tests.helpers import assert_rel_close
from tests.helpers.kda import D, H, K, clone_state, make_config, make_layer, random_state

TOL = 1e-5


GATES = ["lb", "softplus"]


def test_parameter_names_and_shapes_k3():
    layer = KimiDeltaAttention(make_config("lb"), 0)
    C, W = H * K, 4
    expected = {
        "q_proj.weight": (C, D), "k_proj.weight": (C, D), "v_proj.weight": (C, D),
        "q_conv1d.weight": (C, 1, W), "k_conv1d.weight": (C, 1, W), "v_conv1d.weight": (C, 1, W),
        "b_proj.weight": (H, D), "f_a_proj.weight": (K, D), "f_b_proj.weight": (C, K),
        "A_log": (H,), "dt_bias": (C,), "g_proj.weight": (C, D), "o_norm.weight": (K,), "o_proj.weight": (D, C)}
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == expected
    assert layer.A_log.dtype == layer.dt_bias.dtype == torch.float32


def test_parameter_names_and_shapes_kimi_linear():
    shapes = {n: tuple(p.shape) for n, p in KimiDeltaAttention(make_config("softplus"), 0).named_parameters()}
    assert shapes["A_log"] == (1, 1, H, 1)  # the Kimi-Linear checkpoint's layout
    assert shapes["g_a_proj.weight"] == (K, D) and shapes["g_b_proj.weight"] == (H * K, K)
    assert "g_proj.weight" not in shapes


def test_reset_parameters():
    for gate in GATES:
        layer = KimiDeltaAttention(make_config(gate), 0)
        dt = F.softplus(layer.dt_bias)
        assert dt.min() >= 1e-4 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
        assert torch.equal(layer.o_norm.weight, torch.ones(K))
        a = layer.A_log.exp()
        assert torch.equal(a, torch.ones_like(a)) if gate == "lb" else (a.min() >= 1 and a.max() <= 16)
        assert abs(layer.q_proj.weight.std().item() - layer.config.initializer_range) < 0.005


def test_forget_gate_forms():
    x = torch.randn(2, 7, D)
    lb = make_layer("lb")
    z = lb.f_b_proj(lb.f_a_proj(x)) + lb.dt_bias
    expected = -5.0 * torch.sigmoid(lb.A_log.exp().repeat_interleave(K) * z)
    g = activate_gate(*lb.forget_gate(x))
    assert_rel_close("lower-bounded gate", expected.unflatten(-1, (H, K)), g, 1e-6)
    assert (g >= -5).all() and (g <= 0).all()  # (-5, 0) in exact arithmetic; sigmoid saturates in fp32
    sp = make_layer("softplus")
    z = sp.f_b_proj(sp.f_a_proj(x)) + sp.dt_bias
    expected = -sp.A_log.flatten().exp().repeat_interleave(K) * F.softplus(z)
    assert_rel_close("softplus gate", expected.unflatten(-1, (H, K)), activate_gate(*sp.forget_gate(x)), 1e-6)


def test_matches_transformers_kimi_linear_layer():
    transformers = pytest.importorskip("transformers", minversion="5.24")
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    ours = make_layer("softplus")
    hf_config = transformers.KimiLinearConfig(
        hidden_size=D, num_hidden_layers=1, num_attention_heads=2, rms_norm_eps=ours.config.rms_norm_eps,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [], "head_dim": K, "num_heads": H,
                            "short_conv_kernel_size": 4})
    hf = KimiLinearDeltaAttention(hf_config, 0).eval()
    ref_weights = {n: p for n, p in ours.state_dict().items()}
    # transformers fuses the three convs and nests the forget gate (its conversion_mapping)
    renamed = {"conv1d.weight": torch.cat([ref_weights.pop(f"{s}_conv1d.weight") for s in "qkv"])}
    for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
        renamed[f"forget_gate.{name}"] = ref_weights.pop(name)
    hf.load_state_dict({**ref_weights, **renamed}, strict=True)
    x = torch.randn(2, 41, D)
    with torch.no_grad():
        ref = hf(x)
        out = ours(x)
    assert_rel_close("vs transformers KimiLinearDeltaAttention", ref, out, TOL)


@pytest.mark.parametrize("gate", GATES)
def test_chunk_equals_recurrent(gate):
    chunk, recurrent = make_layer(gate, kda_impl="chunk", kda_chunk_size=16), make_layer(gate, kda_impl="recurrent")
    recurrent.load_state_dict(chunk.state_dict())
    x = torch.randn(2, 37, D)
    state_c = random_state(chunk.config, 2)
    state_r = clone_state(state_c)
    y_c, y_r = chunk(x, state=state_c), recurrent(x, state=state_r)
    assert_rel_close("y", y_r, y_c, TOL)
    assert_rel_close("recurrent state", state_r.recurrent, state_c.recurrent, TOL)
    assert torch.equal(state_r.conv, state_c.conv)
    grads = [torch.autograd.grad(y.square().sum(), list(m.parameters())) for y, m in ((y_r, recurrent), (y_c, chunk))]
    for (name, _), ref, out in zip(chunk.named_parameters(), *grads):
        assert_rel_close(f"d{name}", ref, out, TOL)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("splits", [(2, 30, 1, 1), (17, 1, 16)], ids=["2-30-1-1", "17-1-16"])
def test_split_prefill_and_decode_equal_one_pass(gate, splits):
    """Prefix, then suffix and decode steps with carried conv tails and state == one pass (the first
    split is shorter than the conv's W-1 = 3 tail in one case)."""
    layer = make_layer(gate, kda_chunk_size=16)  # impl auto: chunk for T > 1, recurrent for T == 1
    x = torch.randn(2, sum(splits), D)
    whole = KDAState.empty(layer.config, 2)
    with torch.no_grad():
        y = layer(x, state=whole)
        state, parts, start = KDAState.empty(layer.config, 2), [], 0
        for length in splits:
            parts.append(layer(x[:, start:start + length], state=state))
            start += length
    assert_rel_close("y", y, torch.cat(parts, dim=1), TOL)
    assert_rel_close("recurrent state", whole.recurrent, state.recurrent, TOL)
    assert_rel_close("conv tails", whole.conv, state.conv, 1e-6)  # projections of shorter slices round differently
    assert layer(x[:, :5]).shape == (2, 5, D)  # no state: a fresh start, nothing written


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_packed_equals_separate_runs(gate, impl):
    lengths = [2, 23, 1, 9]
    layer = make_layer(gate, kda_impl=impl, kda_chunk_size=16)
    x = torch.randn(1, sum(lengths), D)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed_state = random_state(layer.config, len(lengths))
    initial = clone_state(packed_state)
    with torch.no_grad():
        y = layer(x, cu_seqlens=cu, state=packed_state)
        for n in range(len(lengths)):
            span = slice(cu[n].item(), cu[n + 1].item())
            state_n = initial.select([n])
            y_n = layer(x[:, span], state=state_n)
            assert_rel_close(f"y[seq {n}]", y_n, y[:, span], TOL)
            assert_rel_close(f"recurrent state[seq {n}]", state_n.recurrent, packed_state.recurrent[n:n + 1], TOL)
            assert_rel_close(f"conv tails[seq {n}]", state_n.conv, packed_state.conv[n:n + 1], 1e-6)


@pytest.mark.parametrize("gate", GATES)
def test_prefix_invariance_of_outputs_and_gradients(gate):
    """Perturbing tokens at positions >= i changes no output before i and no gradient of a loss on
    those outputs (fla issue #1240 is this bug in an in-kernel gate; DESIGN §3)."""
    layer = make_layer(gate, kda_impl="chunk", kda_chunk_size=16)
    i, T = 21, 40  # i falls inside the second chunk
    x = torch.randn(2, T, D)
    x_perturbed = x.clone()
    x_perturbed[:, i:] += torch.randn(2, T - i, D)
    weight = torch.randn(2, i, D)
    results = []
    for inp in (x, x_perturbed):
        inp = inp.clone().requires_grad_()
        y = layer(inp)
        grads = torch.autograd.grad((y[:, :i] * weight).sum(), [inp, *layer.parameters()])
        results.append((y[:, :i].detach(), grads))
    (y0, g0), (y1, g1) = results
    assert_rel_close("outputs before i", y0, y1, 1e-6)
    assert_rel_close("dx before i", g0[0][:, :i], g1[0][:, :i], 1e-6)
    assert g0[0][:, i:].abs().max() == 0 and g1[0][:, i:].abs().max() == 0
    for (name, _), a, b in zip(layer.named_parameters(), g0[1:], g1[1:]):
        assert_rel_close(f"d{name}", a, b, 1e-6)


def test_state_shape_errors():
    layer = make_layer("lb")
    x = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match="state.recurrent"):
        layer(x, state=KDAState(torch.zeros(2, 3 * H * K, 3), torch.zeros(2, H, K, K + 1)))
    with pytest.raises(ValueError, match="state.conv"):
        layer(x, state=KDAState.empty(layer.config, 3))


def test_norm_gate_op_is_the_official_formula_and_checks_its_inputs():
    from k3.ops.norm_gate import rms_norm_gated

    o, gate, weight = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16), torch.rand(16) + 0.5
    expected = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * weight * torch.sigmoid(gate)
    assert_rel_close("norm-gate", expected, rms_norm_gated(o, gate, weight, eps=1e-5), 1e-6)
    assert rms_norm_gated(o.bfloat16(), gate.bfloat16(), weight, eps=1e-5).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="gate must have o's shape"):
        rms_norm_gated(o, gate[..., :8], weight, eps=1e-5)
    with pytest.raises(ValueError, match="impl"):
        rms_norm_gated(o, gate, weight, eps=1e-5, impl="triton")
