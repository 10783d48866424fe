"""The KDA and MLA layers on CUDA against the same weights in fp32 on the CPU (`-m gpu`; skipped
without CUDA). k3-1b's widths, unit-scale random weights, random (never zero) states.

A whole KDA layer under bf16 autocast loses more than the per-op 1e-2 on the CPU torch path itself
(bf16 rounding through every projection in series; the gradient of A_log [H] is a sum over B*T*K
terms that cancel, whose error swings 2x with the seed): there the bound is twice the error the
CPU path shows under the same autocast, measured in the same test, so the device may not add much
to what bf16 costs. Every fp32 comparison is held to 1e-4 (fp32 never reaches fla's KDA kernels)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from k3.config import K3Config
from k3.model.cache import KDAState, MLAState
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from tests.helpers import assert_rel_close, rel_err
from tests.helpers.gpu import BF16_TOL, FP32_TOL, gpu_config, unit_scale_

pytestmark = pytest.mark.gpu
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- KDA layer
def kda_layer_config(family: str) -> K3Config:
    """'k3': the lower-bounded sigmoid gate; 'kimi-linear': the softplus gate, low-rank output gate."""
    cfg = gpu_config().replace(kda_impl="auto")
    return cfg if family == "k3" else cfg.replace(gate_lower_bound=None, use_full_rank_gate=False)


@functools.cache
def kda_layer_case(family: str, B: int = 2, T: int = 300):
    """A unit-scale layer (Kimi Linear's decay parameters kept at their official init: unit-scale
    ones would decay by e^-10 per token, a regime no checkpoint is in), input x [B, T, D], a random
    state, and loss weights dy, ds: all on the CPU."""
    torch.manual_seed(0)
    cfg = kda_layer_config(family)
    layer = KimiDeltaAttention(cfg, layer_idx=0)
    decay = {n: p.detach().clone() for n, p in layer.named_parameters() if n in ("A_log", "dt_bias")}
    unit_scale_(layer)
    if family != "k3":
        with torch.no_grad():
            for n, p in layer.named_parameters():
                if n in decay:
                    p.copy_(decay[n])
    x = torch.randn(B, T, cfg.hidden_size)
    state = KDAState.empty(cfg, B)
    state.conv.normal_()
    state.recurrent.normal_(0.0, 0.5)
    return layer, x, state, torch.randn(B, T, cfg.hidden_size), torch.randn_like(state.recurrent)


def kda_layer_pass(family: str, device: torch.device, autocast: bool):
    """Forward from the case's state, backward of <y, dy> + <new state, ds>: y, the new state, dx
    and every parameter's gradient by name, all moved to the CPU."""
    layer, x, state, dy, ds = kda_layer_case(family)
    layer = copy.deepcopy(layer).to(device)
    state = KDAState(state.conv.clone().to(device), state.recurrent.clone().to(device))
    x = x.to(device).requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        y = layer(x, state=state)
    names, params = zip(*layer.named_parameters())
    loss = (y.float() * dy.to(device)).sum() + (state.recurrent * ds.to(device)).sum()
    grads = [g.float().cpu() for g in torch.autograd.grad(loss, (x, *params))]
    outs = {"y": y, "state": state.recurrent, "conv tails": state.conv, "dx": grads[0]}
    outs = {part: t.detach().float().cpu() for part, t in outs.items()}
    return outs, dict(zip(names, grads[1:]))


@functools.cache
def kda_layer_reference(family: str, autocast: bool):
    """kda_layer_pass on the CPU, computed once per module for the tests that share it."""
    return kda_layer_pass(family, CPU, autocast)


@pytest.mark.parametrize("mode", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_kda_layer_on_cuda_matches_cpu_fp32(family, mode):
    """The layer's CUDA path ("auto": fla's conv and norm-gate, and fla's KDA for bf16 / the torch
    chunk path for fp32) continuing a random state: outputs, new state, conv tails, dx and every
    parameter gradient against the layer on CPU fp32."""
    autocast = mode == "bf16-autocast"
    ref, ref_params = kda_layer_reference(family, False)
    outs, params = kda_layer_pass(family, torch.device("cuda"), autocast)
    if autocast:  # what bf16 autocast costs the CPU torch path on the same inputs
        cpu, cpu_params = kda_layer_reference(family, True)
        floor = {part: rel_err(ref[part], cpu[part]) for part in ref}
        floor_params = max(rel_err(ref_params[n], cpu_params[n]) for n in ref_params)
    for part in ref:
        bound = max(BF16_TOL, 2 * floor[part]) if autocast else FP32_TOL
        assert_rel_close(part, ref[part], outs[part], bound)
    for name in ref_params:
        bound = max(BF16_TOL, 2 * floor_params) if autocast else FP32_TOL
        assert_rel_close(f"d{name}", ref_params[name], params[name], bound)


# ----------------------------------------------------------------------------- MLA layer
@functools.cache
def mla_case(lengths: tuple[int, ...] = (37, 100), steps: int = 3):
    """A unit-scale gated MLA layer, a packed prefill x [1, sum(lengths), D] of len(lengths)
    sequences and `steps` decode inputs [steps, N, 1, D]: all on the CPU."""
    torch.manual_seed(0)
    cfg = gpu_config()
    layer = unit_scale_(GatedMLA(cfg, layer_idx=3))
    return layer, torch.randn(1, sum(lengths), cfg.hidden_size), torch.randn(steps, len(lengths), 1, cfg.hidden_size)


@torch.no_grad()
def mla_run(device: torch.device, dtype: torch.dtype, impl: str, lengths: tuple[int, ...] = (37, 100)):
    """A packed prefill of the sequences into a cache, then single-token decode steps: the outputs
    [sum(lengths) + steps * N, D] and every sequence's cached latents, on the CPU in fp32."""
    layer, x_prefill, x_steps = mla_case(lengths)
    m = copy.deepcopy(layer).to(device, dtype)
    m.config = m.config.replace(mla_impl=impl)
    N = len(lengths)
    cu = torch.tensor([0, *lengths], device=device).cumsum(0)
    state = MLAState.empty(m.config, N, device, dtype, capacity=max(lengths) + x_steps.shape[0])
    outs = [m(x_prefill.to(device, dtype), cu_seqlens=cu, state=state)[0]]
    outs += [m(x.to(device, dtype), state=state)[:, 0] for x in x_steps]
    latents = torch.cat([state.rows(n) for n in range(N)])
    return torch.cat(outs).float().cpu(), latents.float().cpu()


MLA_CASES = [(torch.bfloat16, "naive"), (torch.bfloat16, "absorb"), (torch.float32, "absorb")]


@pytest.mark.parametrize("dtype,impl", MLA_CASES, ids=["bf16-naive", "bf16-absorb", "fp32-absorb"])
def test_mla_prefill_and_decode_on_cuda_match_cpu_fp32(dtype, impl):
    """Gated MLA with a cache on CUDA, naive or absorbed: a packed prefill of two sequences, then 3
    decode steps; outputs and cached latents against the naive path on CPU fp32."""
    y_ref, lat_ref = mla_run(CPU, torch.float32, "naive")
    y, lat = mla_run(torch.device("cuda"), dtype, impl)
    bound = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert_rel_close("outputs (prefill + 3 decode steps)", y_ref, y, bound)
    assert_rel_close("cached latents", lat_ref, lat, bound)
