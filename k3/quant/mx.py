"""MX block formats (OCP Microscaling v1.0, DESIGN §9): quantize / dequantize along the last dim.

N elements along the last dim; every BLOCK = 32 consecutive elements share one E8M0 scale 2^e
(a biased exponent byte: code = e + 127, code 255 = NaN). Elements are E2M1 (MXFP4), E4M3 or
E5M2 (MXFP8). A value decodes as element * 2^e.

Two rules pick e from the block's largest magnitude amax:
- "floor" (OCP v1.0 §6.3): e = floor(log2(amax)) - emax_elem; the scaled amax may exceed the
  element max by < 2x, and such elements saturate to +-max.
- "ceil"  (K3 checkpoint, DESIGN §9): e = ceil(log2(amax / max_elem)); the smallest scale whose
  range covers amax, so nothing ever saturates.
Either way elements round to nearest, ties to even, and e is clamped to E8M0's [-127, 127].
Special blocks: amax = 0 takes the smallest scale (code 0) and all-zero elements; a block holding
NaN or Inf gets the NaN scale (code 255) and decodes to all NaN: E2M1 and E4M3 cannot represent
Inf, so poisoning the block is the one loud outcome (torchao, our test oracle, gives NaN blocks
code 255 as well; for Inf it saturates instead).

Storage: E2M1 codes are sign-magnitude nibbles (bit 3 = sign, bits 0-2 index the magnitudes
0, .5, 1, 1.5, 2, 3, 4, 6) packed two per byte, the even element in the LOW nibble — the
compressed-tensors `pack_fp4_to_uint8` layout read by vLLM's `mxfp4-pack-quantized` scheme.
E4M3/E5M2 elements are torch's float8_e4m3fn / float8_e5m2 tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
Rule = Literal["floor", "ceil"]
RULES = ("floor", "ceil")
_RNE_SHIFT = 1.5 * 2.0 ** 23  # see round_to_element


@dataclass(frozen=True)
class ElementFormat:
    name: str
    ebits: int
    mbits: int
    max: float  # largest finite magnitude
    torch_dtype: torch.dtype | None  # 8-bit storage dtype; None: 4-bit codes packed two per byte

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal; subnormals share its step."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two <= max (OCP's emax_elem)."""
        return math.floor(math.log2(self.max))

    def magnitudes(self, device=None) -> torch.Tensor:
        """Non-negative values indexed by their (exponent | mantissa) bits; used for 4-bit codes."""
        values = []
        for code in range(2 ** (self.ebits + self.mbits)):
            exp_field, man = code >> self.mbits, code & (2 ** self.mbits - 1)
            frac = man / 2 ** self.mbits
            values.append(frac * 2.0 ** self.emin if exp_field == 0 else (1 + frac) * 2.0 ** (exp_field - self.bias))
        return torch.tensor(values, dtype=torch.float32, device=device)


E2M1 = ElementFormat("e2m1", ebits=2, mbits=1, max=6.0, torch_dtype=None)
E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, max=448.0, torch_dtype=torch.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", ebits=5, mbits=2, max=57344.0, torch_dtype=torch.float8_e5m2)


# ------------------------------------------------------------------------------- scales
def e8m0_scale(amax: torch.Tensor, fmt: ElementFormat, rule: Rule) -> torch.Tensor:
    """E8M0 codes (uint8, same shape as amax) for blocks whose largest magnitude is amax."""
    if rule not in RULES:
        raise ValueError(f"unknown MX scale rule {rule!r}; expected one of {RULES}")
    amax = amax.float()
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): exact floor(log2) = exp - 1
    e = exp.to(torch.int32) - 1 - fmt.emax
    if rule == "ceil":
        # max * 2^(floor(log2 amax) - emax) lies in [2^f, 2^(f+1)), so the smallest e with
        # max * 2^e >= amax is that exponent or the next one; compare exactly in fp64.
        reach = torch.ldexp(torch.full_like(amax, fmt.max, dtype=torch.float64), e.double())
        e = e + (amax.double() > reach).to(torch.int32)
    e = torch.where(amax == 0, -E8M0_BIAS, e).clamp(-E8M0_BIAS, E8M0_BIAS)
    code = (e + E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, E8M0_NAN))


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) in fp32 built from its bits (exact; code 0 is the subnormal 2^-127), NaN for 255."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 codes, got {codes.dtype}")
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 1 << 22), c << 23)
    scale = bits.view(torch.float32)
    return torch.where(c == E8M0_NAN, torch.full_like(scale, float("nan")), scale)


# ------------------------------------------------------------------------------- elements
def round_to_element(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """fp32 v (already divided by the block scale) -> nearest fmt value, ties to even, saturating.

    Inside a binade the representable values are integer multiples of 2^(e - mbits), so rounding
    the multiple half-to-even rounds to the code with an even mantissa. The multiple is below
    2^(mbits+1) <= 16, so adding 1.5 * 2^23 lands it where the fp32 ulp is 1 and IEEE addition
    itself rounds it to the nearest even integer; torch.round does the same but its CPU kernel
    is ~300x slower, which dominated a QAT step."""
    mag = v.abs().clamp(max=fmt.max)
    _, exp = torch.frexp(mag)
    e = (exp.to(torch.int32) - 1).clamp(min=fmt.emin)
    step = torch.ldexp(torch.ones_like(mag), (e - fmt.mbits).float())
    multiple = (mag / step + _RNE_SHIFT) - _RNE_SHIFT
    return torch.copysign(multiple * step, v)


def _to_blocks(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"MX quantization needs the last dim to be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"MX quantization takes a floating-point tensor, got {x.dtype}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _quantize_blocks(x: torch.Tensor, fmt: ElementFormat, rule: Rule) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (elements as fp32 values [..., N/32, 32], E8M0 codes [..., N/32]); NaN blocks hold zeros."""
    xb = _to_blocks(x)
    codes = e8m0_scale(xb.abs().amax(-1), fmt, rule)
    elems = round_to_element(xb / e8m0_to_float(codes).unsqueeze(-1), fmt)
    elems = torch.where((codes == E8M0_NAN).unsqueeze(-1), 0.0, elems)
    return elems, codes


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [..., N] -> bytes [..., N/2], element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., N/2] -> uint8 nibbles [..., N], low nibble first."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# ------------------------------------------------------------------------------- public ops
def quantize(x: torch.Tensor, fmt: ElementFormat, rule: Rule = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (elements, scales).

    elements: E2M1 -> uint8 [..., N/2] (packed nibbles); E4M3/E5M2 -> fmt.torch_dtype [..., N].
    scales: uint8 E8M0 codes [..., N/32]."""
    elems, codes = _quantize_blocks(x, fmt, rule)
    elems = elems.flatten(-2)
    if fmt.torch_dtype is not None:
        return elems.to(fmt.torch_dtype), codes  # exact: elems already lie on the format's grid
    magnitude_index = torch.searchsorted(fmt.magnitudes(elems.device), elems.abs()).to(torch.uint8)
    nibbles = magnitude_index | (torch.signbit(elems).to(torch.uint8) << 3)
    return pack_fp4(nibbles), codes


def dequantize(elements: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: (elements, scales) -> values [..., N] in dtype (exact for fp32/bf16)."""
    if fmt.torch_dtype is not None:
        if elements.dtype != fmt.torch_dtype:
            raise TypeError(f"{fmt.name} elements must be {fmt.torch_dtype}, got {elements.dtype}")
        values = elements.float()
    else:
        if elements.dtype != torch.uint8:
            raise TypeError(f"packed {fmt.name} elements must be uint8, got {elements.dtype}")
        nibbles = unpack_fp4(elements)
        values = fmt.magnitudes(elements.device)[(nibbles & 0x07).long()]
        values = torch.where((nibbles & 0x08).bool(), -values, values)
    if values.shape[-1] != scales.shape[-1] * BLOCK or values.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"{fmt.name}: elements decode to {tuple(values.shape)}, which does not match "
                         f"scales {tuple(scales.shape)} with blocks of {BLOCK}")
    blocks = values.reshape(*scales.shape, BLOCK) * e8m0_to_float(scales).unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


def fake_quantize(x: torch.Tensor, fmt: ElementFormat, rule: Rule = "floor") -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype without encoding (the QAT forward, DESIGN §9)."""
    elems, codes = _quantize_blocks(x, fmt, rule)
    return (elems * e8m0_to_float(codes).unsqueeze(-1)).flatten(-2).to(x.dtype)
