"""MX formats (DESIGN §9): bit-exact against torchao's reference `to_mx` (OCP floor rule) and a
hand-checked edge-case table for both scale rules."""
from __future__ import annotations

import math

import pytest
import torch

from k3.quant.mx import (
    BLOCK,
    E2M1,
    E4M3,
    E5M2,
    dequantize,
    e8m0_scale,
    e8m0_to_float,
    fake_quantize,
    pack_fp4,
    quantize,
    unpack_fp4,
)

NAN = float("nan")
F32_AFTER_6 = 6.0 + 2.0 ** -21  # the next fp32 after 6; fp32 ceil(log2(amax) - log2(6)) gives 0

# (format, rule, leading block values (the rest of the block is 0), scale code, decoded values).
# Worked by hand from DESIGN §9 / OCP v1.0: floor e = floor(log2 amax) - emax (E2M1 2, E4M3 8,
# E5M2 15), ceil e = smallest e with max * 2^e >= amax, code = e + 127, ties to the even mantissa.
EDGE_CASES = [
    # exact powers of two: both rules agree
    ("pow2-4", E2M1, "floor", [4.0, 1.0], 127, [4.0, 1.0]),
    ("pow2-4", E2M1, "ceil", [4.0, 1.0], 127, [4.0, 1.0]),
    ("pow2-8", E2M1, "floor", [8.0, -0.5], 128, [8.0, 0.0]),  # -0.25 in element units: tie -> 0
    ("pow2-8", E2M1, "ceil", [8.0, -0.5], 128, [8.0, 0.0]),
    ("pow2-1", E2M1, "floor", [1.0, 0.125], 125, [1.0, 0.125]),
    ("pow2-1", E2M1, "ceil", [1.0, 0.125], 125, [1.0, 0.125]),
    # +-6 fills the range exactly
    ("pm6", E2M1, "floor", [6.0, -6.0], 127, [6.0, -6.0]),
    ("pm6", E2M1, "ceil", [6.0, -6.0], 127, [6.0, -6.0]),
    # values between codes (scale 1): 2.4 -> 2, 2.6 -> 3, 5.1 -> 6, 0.3 -> 0.5, 0.2 -> 0, -3.9 -> -4
    ("between", E2M1, "floor", [6.0, 2.4, 2.6, 5.1, 0.3, 0.2, -3.9], 127, [6.0, 2.0, 3.0, 6.0, 0.5, 0.0, -4.0]),
    ("between", E2M1, "ceil", [6.0, 2.4, 2.6, 5.1, 0.3, 0.2, -3.9], 127, [6.0, 2.0, 3.0, 6.0, 0.5, 0.0, -4.0]),
    # ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, -2.5->-2
    ("ties", E2M1, "floor", [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5], 127,
     [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0]),
    ("ties", E2M1, "ceil", [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5], 127,
     [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0]),
    # where the rules differ: floor saturates, ceil moves up one binade and never saturates
    ("amax7", E2M1, "floor", [7.0, 1.0], 127, [6.0, 1.0]),
    ("amax7", E2M1, "ceil", [7.0, 1.0], 128, [8.0, 1.0]),  # 3.5 -> tie -> 4; 0.5 stays
    ("amax6.5", E2M1, "floor", [6.5], 127, [6.0]),
    ("amax6.5", E2M1, "ceil", [6.5], 128, [6.0]),  # 3.25 -> 3
    ("amax3.1", E2M1, "floor", [3.1], 126, [3.0]),  # 6.2 saturates to 6
    ("amax3.1", E2M1, "ceil", [3.1], 127, [3.0]),
    ("after6", E2M1, "floor", [F32_AFTER_6], 127, [6.0]),
    ("after6", E2M1, "ceil", [F32_AFTER_6], 128, [6.0]),  # exact ceil: 6+ needs the next scale
    # amax 0: the smallest scale, all zeros
    ("zeros", E2M1, "floor", [0.0], 0, [0.0]),
    ("zeros", E2M1, "ceil", [0.0], 0, [0.0]),
    ("zeros", E4M3, "floor", [0.0], 0, [0.0]),
    # subnormal-range inputs: fp32 subnormals clamp to code 0 (2^-127), then round in element units
    ("f32-subnormal", E2M1, "floor", [2.0 ** -130], 0, [0.0]),  # 0.125 in element units -> 0
    ("f32-subnormal", E2M1, "ceil", [2.0 ** -130], 0, [0.0]),
    ("f32-min-normal", E2M1, "floor", [2.0 ** -126, 2.0 ** -127], 0, [2.0 ** -126, 2.0 ** -127]),
    ("f32-min-normal", E2M1, "ceil", [2.0 ** -126, 2.0 ** -127], 0, [2.0 ** -126, 2.0 ** -127]),
    ("huge", E2M1, "floor", [1.5 * 2.0 ** 127], 252, [1.5 * 2.0 ** 127]),
    ("huge", E2M1, "ceil", [1.5 * 2.0 ** 127], 252, [1.5 * 2.0 ** 127]),
    # E4M3 (max 448 = 1.75 * 2^8): saturation vs ceil, ties, and its own subnormals (step 2^-9)
    ("e4m3-448", E4M3, "floor", [448.0, 17.0, 19.0], 127, [448.0, 16.0, 20.0]),  # ties, step 2 in [16, 32)
    ("e4m3-448", E4M3, "ceil", [448.0, 17.0, 19.0], 127, [448.0, 16.0, 20.0]),
    ("e4m3-480", E4M3, "floor", [480.0], 127, [448.0]),
    ("e4m3-480", E4M3, "ceil", [480.0], 128, [480.0]),
    ("e4m3-subnormal", E4M3, "floor", [448.0, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -10], 127,
     [448.0, 2.0 ** -9, 2.0 ** -8, 0.0]),
    ("e4m3-pow2", E4M3, "floor", [1.0], 119, [1.0]),
    ("e4m3-pow2", E4M3, "ceil", [1.0], 119, [1.0]),  # ceil(log2(1/448)) = -8
    # E5M2 (max 57344 = 1.75 * 2^15)
    ("e5m2-max", E5M2, "floor", [57344.0, 4.5, 5.5], 127, [57344.0, 4.0, 6.0]),
    ("e5m2-60000", E5M2, "floor", [60000.0], 127, [57344.0]),
    ("e5m2-60000", E5M2, "ceil", [60000.0], 128, [57344.0]),  # 30000 -> 7 * 4096 = 28672
    # NaN / Inf poison the block: NaN scale, every element decodes to NaN
    ("nan", E2M1, "floor", [1.0, NAN], 255, [NAN] * BLOCK),
    ("inf", E2M1, "ceil", [1.0, math.inf], 255, [NAN] * BLOCK),
    ("nan", E4M3, "floor", [NAN], 255, [NAN] * BLOCK),
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=[f"{c[0]}-{c[1].name}-{c[2]}" for c in EDGE_CASES])
def test_edge_cases(case):
    _, fmt, rule, values, code, decoded = case
    x = torch.zeros(BLOCK, dtype=torch.float32)
    x[:len(values)] = torch.tensor(values, dtype=torch.float32)
    elements, scales = quantize(x, fmt, rule)
    assert scales.tolist() == [code]
    want = torch.zeros(BLOCK, dtype=torch.float32)
    want[:len(decoded)] = torch.tensor(decoded, dtype=torch.float32)
    got = dequantize(elements, scales, fmt)
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), (got[:len(decoded)], want[:len(decoded)])
    assert torch.equal(fake_quantize(x, fmt, rule).nan_to_num(), want.nan_to_num())


def test_fp4_codes_and_nibble_order():
    # +6 = 0b0111, -6 = 0b1111 (bit 3 = sign); the even element sits in the low nibble
    elements, _ = quantize(torch.tensor([6.0, -6.0] + [0.0] * 30), E2M1, "ceil")
    assert elements[0].item() == 0xF7
    codes = torch.tensor([1, 2, 15, 0], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [0x21, 0x0F]
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)
    assert E2M1.magnitudes().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e8m0_decode():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    want = [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    got = e8m0_to_float(codes)
    assert got[:-1].tolist() == want and math.isnan(got[-1].item())


@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2], ids=lambda f: f.name)
def test_ceil_rule_is_minimal_and_never_saturates(fmt):
    x = torch.randn(64, 8 * BLOCK) * torch.logspace(-20, 20, 64)[:, None]
    amax = x.reshape(64, -1, BLOCK).abs().amax(-1).double()
    e = e8m0_scale(amax.float(), fmt, "ceil").double() - 127
    assert (amax <= fmt.max * 2 ** e).all() and (amax > fmt.max * 2 ** (e - 1)).all()
    elements, scales = quantize(x, fmt, "ceil")
    err = (dequantize(elements, scales, fmt) - x).abs().reshape(64, -1, BLOCK)
    # no saturation: the error is at most half the top binade's step
    step = 2.0 ** (e + math.floor(math.log2(fmt.max)) - fmt.mbits)
    assert (err.double() <= step.unsqueeze(-1) / 2).all()


@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_fake_quantize_equals_round_trip(fmt, rule):
    x = torch.randn(4, 3, 4 * BLOCK, dtype=torch.bfloat16) * 3
    elements, scales = quantize(x, fmt, rule)
    assert scales.shape == (4, 3, 4) and scales.dtype == torch.uint8
    assert elements.shape[-1] == (2 * BLOCK if fmt is E2M1 else 4 * BLOCK)
    assert torch.equal(fake_quantize(x, fmt, rule), dequantize(elements, scales, fmt, torch.bfloat16))


def test_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48), E2M1)
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        quantize(torch.randn(32), E2M1, "nearest")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(32, dtype=torch.int32), E2M1)
    with pytest.raises(ValueError, match="does not match"):
        dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), E2M1)


# ----------------------------------------------------------------------- torchao oracle
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2], ids=lambda f: f.name)
def test_floor_rule_bit_exact_with_torchao(fmt, dtype):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    ao_dtype = {"e2m1": torch.float4_e2m1fn_x2, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt.name]
    # magnitudes spanning 2^-40 .. 2^40 so every scale path and element binade is hit
    x = (torch.randn(96, 16 * BLOCK) * torch.logspace(-12, 12, 96)[:, None]).to(dtype)
    x[0, :BLOCK] = 0.0  # an all-zero block
    ao_scales, ao_elements = mx_tensor.to_mx(x, ao_dtype, BLOCK)
    elements, scales = quantize(x, fmt, "floor")
    assert torch.equal(scales, ao_scales.view(torch.uint8))
    assert torch.equal(elements.view(torch.uint8), ao_elements.view(torch.uint8))
