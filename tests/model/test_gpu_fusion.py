"""Fused input projections (k3/model/fusion.py) on CUDA in bf16 (`-m gpu`; skipped without CUDA):
each layer at k3-1b's widths through fla's kernels (the conv and the output norm-gate then read
strided views of the fused product), the whole model's prefill, eager decode and CUDA-graph decode
against the unfused eager model and against the CPU fp32 reference, and the GEMM kernels of a
decode step counted by torch.profiler. The fused GEMM may pick another cuBLAS kernel than the
separate ones, so fused and unfused bf16 differ by rounding: held to the bf16 bars of
tests/helpers/gpu.py, never bit-equality."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.serve.decode_graph import CUDAGraphDecoder, capturable_experts
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, bf16_reference, dense_routing_model, gpu_config, model_bound, unit_scale_
from tests.model.test_fusion import CountMatmuls

pytestmark = pytest.mark.gpu
GEMM_KERNEL = re.compile(r"gemm|gemv|xmma|cutlass|splitK|nvjet", re.IGNORECASE)  # nvjet: cuBLASLt on sm90


@pytest.mark.parametrize("kind", ["kda", "mla"])
@torch.no_grad()
def test_layer_fused_equals_eager_bf16(kind, B=2, T=300):
    cfg = gpu_config().replace(kda_impl="auto")
    torch.manual_seed(0)
    layer = unit_scale_((KimiDeltaAttention if kind == "kda" else GatedMLA)(cfg, 0)).to("cuda", torch.bfloat16).eval()
    fused = copy.deepcopy(layer)
    assert "fused" in fused.fuse_input_projections()
    x = torch.randn(B, T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    if kind == "kda":
        state = KDAState.empty(cfg, B, device="cuda", dtype=torch.bfloat16)
        state.conv.normal_()
        state.recurrent.normal_(0.0, 0.5)
    else:
        state = MLAState.empty(cfg, B, device="cuda", dtype=torch.bfloat16, capacity=T + 8)
    for name, xs in (("prefill", x), ("decode", x[:, :1])):
        outs = [m(xs, state=copy.deepcopy(state)) for m in (layer, fused)]
        assert_rel_close(f"{kind} {name}: fused vs eager", outs[0].float(), outs[1].float(), BF16_TOL)


@torch.no_grad()
def test_model_fused_prefill_and_graph_decode_bf16(B=2, T=200, steps=4):
    model = dense_routing_model()
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    reference, floor = bf16_reference(model, ids)
    eager = copy.deepcopy(model).to("cuda", torch.bfloat16)
    fused = copy.deepcopy(eager)
    fused.fuse_projections()
    ids = ids.cuda()
    assert_rel_close("prefill: fused vs eager", eager(ids).float().cpu(), fused(ids).float().cpu(), BF16_TOL)
    assert_rel_close(f"prefill: fused vs cpu fp32 (cpu bf16: {floor:.1e})", reference, fused(ids).cpu(),
                     model_bound(floor))
    decoded = {}
    for name, m in (("eager", eager), ("fused", fused)):
        cache = K3Cache.empty(m.config, B, device="cuda", dtype=torch.bfloat16, capacity=T)
        m(ids[:, :-steps], cache=cache)
        decoded[name] = torch.cat([m(ids[:, t:t + 1], cache=cache) for t in range(T - steps, T)], 1).cpu()
    assert_rel_close("eager decode: fused vs unfused", decoded["eager"], decoded["fused"], BF16_TOL)
    if capturable_experts(fused):  # a CUDA graph captures the fused GEMMs
        cache = K3Cache.empty(fused.config, B, device="cuda", dtype=torch.bfloat16, capacity=T)
        fused(ids[:, :-steps], cache=cache)
        decoder = CUDAGraphDecoder(fused, cache)
        graphed = torch.stack([decoder.step(ids[:, t]).clone() for t in range(T - steps, T)], 1).cpu()
        assert_rel_close("graph decode: fused vs unfused eager", decoded["eager"], graphed, BF16_TOL)
        assert_rel_close(f"graph decode: fused vs cpu fp32 (cpu bf16: {floor:.1e})", reference[:, -steps:], graphed,
                         model_bound(floor))


@torch.no_grad()
def test_decode_step_launches_fewer_gemm_kernels(B=4, context=64):
    model = dense_routing_model().to("cuda", torch.bfloat16)
    fused = copy.deepcopy(model)
    fused.fuse_projections()
    cfg = model.config
    kda = sum(not cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    ops, kernels, names = [], [], []
    for m in (model, fused):
        cache = K3Cache.empty(cfg, B, device="cuda", dtype=torch.bfloat16, capacity=context + 8)
        m(torch.zeros(B, context, dtype=torch.long, device="cuda"), cache=cache)
        tokens = torch.zeros(B, 1, dtype=torch.long, device="cuda")
        m(tokens, cache=cache)  # warm: cuBLAS handles, fla autotuning
        torch.cuda.synchronize()
        with CountMatmuls() as mode:
            m(tokens, cache=cache)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m(tokens, cache=cache)
            torch.cuda.synchronize()
        ops.append(mode.count)
        launched = {e.key: e.count for e in prof.key_averages() if e.device_type.name == "CUDA"}
        kernels.append(sum(n for key, n in launched.items() if GEMM_KERNEL.search(key)))
        names.append(sorted(launched, key=launched.get, reverse=True)[:12])
    assert ops[0] - ops[1] == 5 * kda + 2 * (cfg.num_hidden_layers - kda), ops
    assert kernels[1] < kernels[0], (f"GEMM kernels per decode step: unfused {kernels[0]}, fused {kernels[1]}; "
                                  f"most launched (unfused): {names[0]}")
