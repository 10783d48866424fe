"""The vision encoder on CUDA (`-m gpu`; skipped without CUDA): bf16 attention through the varlen
flash kernel against one SDPA call per image, and the whole tiny encoder against fp32 on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch

from k3.model.vision.tower import attention_per_sequence, image_attention, image_cu_seqlens
from tests.helpers import assert_rel_close
from tests.model.vision.helpers import GRIDS, pixels, tiny_model

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_varlen_kernel_matches_per_image_sdpa_bf16():
    g = torch.tensor([(1, 7, 9), (3, 4, 6), (1, 30, 20), (1, 2, 2)])
    cu = image_cu_seqlens(g, CUDA)
    q, k, v = (torch.randn(int(g.prod(-1).sum()), 4, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    fast = image_attention(q, k, v, cu, int(g.prod(-1).max()))
    ref = attention_per_sequence(q.float(), k.float(), v.float(), cu)
    assert_rel_close("varlen", ref, fast, 1e-2)


def test_encoder_bf16_on_cuda_matches_fp32_cpu_and_packs():
    cpu_model = tiny_model()
    model = copy.deepcopy(cpu_model).to(CUDA, torch.bfloat16)
    px, g = pixels(GRIDS, cpu_model.config.patch_size)
    with torch.no_grad():
        ref = cpu_model(px, g)
        out = model(px.to(CUDA), g)
    assert_rel_close("bf16 cuda", ref, out.float().cpu(), 3e-2)
    start, counts = 0, model.merged_counts(g)
    for i, (t, h, w) in enumerate(GRIDS):  # each image alone gives the same tokens (bf16 kernel)
        with torch.no_grad():
            alone = model(px[start:start + t * h * w].to(CUDA), g[i:i + 1])
        assert_rel_close(f"image {i}", alone.float(), out[sum(counts[:i]):sum(counts[:i + 1])].float(), 1e-2)
        start += t * h * w
    out = model(px.to(CUDA), g)
    out.float().pow(2).mean().backward()  # the varlen kernel has a backward
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
