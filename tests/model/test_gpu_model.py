"""The whole model on CUDA (`-m gpu`; skipped without CUDA): logits against the CPU fp32 forward,
and decode (a prefill into a cache, then single-token steps) against one full forward.

bf16 runs are compared with the fp32 forward of the same bf16-rounded weights on the CPU, under the
bound that what bf16 costs the CPU torch path sets (tests/helpers/gpu.py: `bf16_reference`,
`model_bound`); fp32 runs are held to 1e-4. The decode steps replayed from CUDA graphs, with and
without compiled regions, are tested in tests/serve/test_decode_graph.py."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from k3.model.cache import K3Cache
from tests.helpers import assert_rel_close
from tests.helpers.gpu import FP32_TOL, bf16_reference, dense_routing_model, model_bound

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


@functools.cache
def model_case(B: int = 2, T: int = 200):
    """The model, ids [B, T] and the CPU references: fp32 logits, and the fp32 logits of the
    bf16-rounded weights with what the CPU's own bf16 forward loses against them."""
    model = dense_routing_model()
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref32 = model(ids)
    return model, ids, ref32, *bf16_reference(model, ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_model_logits_on_cuda_match_cpu(dtype):
    model, ids, ref32, ref16, floor = model_case()
    with torch.no_grad():
        out = copy.deepcopy(model).to(CUDA, dtype)(ids.to(CUDA)).float().cpu()
    if dtype == torch.float32:
        assert_rel_close("fp32 logits vs cpu fp32", ref32, out, FP32_TOL)
    else:
        assert_rel_close(f"bf16 logits vs cpu fp32 of the rounded weights (cpu bf16: {floor:.1e})", ref16, out,
                         model_bound(floor))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_on_cuda_matches_prefill(dtype, steps=4):
    """A prefill of T-4 tokens into a cache, then 4 single-token steps (chunk, then recurrent
    kernels) give the last 4 logits of one full forward. fp32: against the device's own full
    forward (the property itself); bf16: both against the fp32 reference of the same rounded
    weights (two bf16 paths compared with each other would count both their roundings)."""
    model, ids, _, ref16, floor = model_case()
    B, T = ids.shape
    m, ids = copy.deepcopy(model).to(CUDA, dtype), ids.to(CUDA)
    with torch.no_grad():
        full = m(ids)[:, -steps:].float().cpu()
        cache = K3Cache.empty(m.config, B, device=CUDA, dtype=dtype)
        m(ids[:, :-steps], cache=cache)
        stepped = torch.cat([m(ids[:, t:t + 1], cache=cache) for t in range(T - steps, T)], 1).float().cpu()
    if dtype == torch.float32:
        assert_rel_close("decode = prefill", full, stepped, FP32_TOL)
    else:
        bound = model_bound(floor)
        assert_rel_close(f"prefill vs cpu fp32 (cpu bf16: {floor:.1e})", ref16[:, -steps:], full, bound)
        assert_rel_close(f"decode vs cpu fp32 (cpu bf16: {floor:.1e})", ref16[:, -steps:], stepped, bound)
