"""Host-free mode (k3.ops.host_free) on CUDA: the KDA op (fla, `use_graph`), the masked short conv, an
MLA layer and a small whole model, forward and backward in bf16 on a packed row padded with
zero-length documents. Each equals the normal path on the real documents, and the same call
captured once in a CUDA graph and replayed with OTHER document boundaries (same padded length)
equals it run eagerly on them. `-m gpu`; skipped without CUDA or fla+triton. Small shapes
(T 512, k3-tiny's 4 heads of 32) so the file runs in seconds; the CPU side is tests/ops/test_host_free_ops.py."""
from __future__ import annotations

import pytest
import torch

from bench.common import graphed
from k3.model.mla import GatedMLA
from k3.model.transformer import K3ForCausalLM
from k3.ops import fla_kernels
from k3.ops.conv import causal_conv1d
from k3.ops.host_free import host_free
from k3.ops.kda import kda
from tests.helpers import assert_rel_close
from tests.helpers.gpu import BF16_TOL, EXACT, side_stream, unit_scale_  # noqa: F401 (a fixture)
from tests.helpers.kda import make_gate, make_inputs
from tests.helpers.models import small_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_kernels.available(), reason="needs fla-core with triton"),
              pytest.mark.usefixtures("side_stream")]
T, H, K = 512, 4, 32  # k3-tiny's KDA heads: its runs leave these fla kernels in the Triton cache
# two packings of the same T into at most 7 documents: 1-token ones, a zero-length one inside, tails
ROW_A = [0, 100, 101, 400, 512, 512, 512, 512]
ROW_B = [0, 37, 37, 300, 301, 302, 511, 512]


def real(bounds: list[int]) -> torch.Tensor:
    return torch.tensor(sorted(set(bounds)), device="cuda")


def check_capture(run, leaves, name, against_normal=None):
    """run(cu) -> output (under autograd): host-free on ROW_A = normal on its real documents (the
    first `against_normal` of output and grads; all by default); then the graph captured on ROW_A,
    replayed on ROW_B = host-free eager on ROW_B, output and grads."""
    dy = None

    def fwd_bwd(cu):
        nonlocal dy
        out = run(cu)
        dy = torch.randn_like(out) if dy is None else dy
        return (out, *torch.autograd.grad(out, leaves, dy, materialize_grads=True))

    normal = fwd_bwd(real(ROW_A))
    cu = torch.tensor(ROW_A, device="cuda")
    with host_free():
        eager = fwd_bwd(cu)
        for i, (r, o) in enumerate(zip(normal[:against_normal], eager[:against_normal], strict=True)):
            assert_rel_close(f"{name} host-free vs normal [{i}]", r.float(), o.float(), BF16_TOL)
        graph, static = graphed(lambda: fwd_bwd(cu))
        cu.copy_(torch.tensor(ROW_B, device="cuda"))
        graph.replay()
        want = fwd_bwd(torch.tensor(ROW_B, device="cuda"))
    for i, (r, o) in enumerate(zip(want, static, strict=True)):
        assert_rel_close(f"{name} replay on other boundaries [{i}]", r.float(), o.float(), EXACT)


def test_kda_fla_captured():
    q, k, v, _, beta, _ = make_inputs(1, T, H, K, K, "lb", with_state=False)
    g_raw, gate = make_gate(1, T, H, K, "lb")
    leaves = [t.cuda().requires_grad_() for t in (q.bfloat16(), k.bfloat16(), v.bfloat16(), g_raw, beta)]
    gate = type(gate)(gate.A_log.cuda(), gate.dt_bias.cuda(), gate.lower_bound)
    check_capture(lambda cu: kda(*leaves, cu_seqlens=cu, gate=gate, normalize_qk=True)[0], leaves, "kda")


def test_conv_captured():
    x = torch.randn(1, T, H * K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(H * K, 4, device="cuda") / 2).bfloat16().requires_grad_()
    check_capture(lambda cu: causal_conv1d(x, w, cu_seqlens=cu, activation="silu")[0], [x, w], "conv")


def test_mla_layer_captured():
    cfg = small_config(hidden_size=128, num_attention_heads=H, qk_nope_head_dim=K, v_head_dim=K, mla_use_nope=False)
    layer = unit_scale_(GatedMLA(cfg, 3)).to("cuda", torch.bfloat16)
    x = torch.randn(1, T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    check_capture(lambda cu: layer(x, cu_seqlens=cu), [x, *layer.parameters()], "mla")


def test_model_captured():
    """KDA layers share fla's static graph buffers: a whole model's step checks they do not collide.
    Every token routed to every expert: bf16 rounding would flip near-tied top-k choices between
    the two paths (tests.helpers.gpu.dense_routing_model). Against the normal path only the logits:
    eight bf16 layers' gradients differ by ~1e-2 between any two summation orders (the per-layer
    tests above and the fp32 CPU test compare gradients)."""
    cfg = small_config(kda_head_dim=K, kda_num_heads=H, kda_chunk_size=64)
    model = K3ForCausalLM(cfg.replace(num_experts_per_token=cfg.num_experts)).to("cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]

    def run(cu):
        return model(ids, cu_seqlens=cu)

    check_capture(run, params, "model", against_normal=1)
