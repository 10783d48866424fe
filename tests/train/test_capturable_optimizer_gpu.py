"""The capturable optimizer step and balance update on CUDA (`-m gpu`; skipped without CUDA): the
router records, `PerHeadMuon.step()` (capturable), `max_load` and `balance_step` captured as one
torch.cuda.CUDAGraph and replayed with new gradients, router inputs and lrs (filled in place)
equal the same steps run eagerly; the eager step does not synchronize with the host. k3-tiny."""
from __future__ import annotations

import pytest
import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.train.balance import balance_step, max_load, moe_layers
from k3.train.muon import PerHeadMuon, param_groups
from tests.helpers import assert_rel_close
from tests.helpers.gpu import EXACT

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
TOKENS = 64


def setup():
    """k3-tiny on CUDA with a capturable optimizer; every parameter holds a gradient tensor (a
    graph reads gradients from fixed addresses)."""
    config = load_config("k3-tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(config).to(CUDA).train()
    opt = PerHeadMuon(param_groups(model, config, weight_decay=0.1), lr=3e-3, capturable=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, opt


def batches(model, n: int, seed: int):
    """n steps of (gradients, router inputs per MoE layer, lr), the same for every model."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    hidden = next(iter(moe_layers(model).values())).hidden_size
    return [([torch.randn(p.shape, device=CUDA, generator=g) * 1e-2 for p in model.parameters()],
             [torch.randn(TOKENS, hidden, device=CUDA, generator=g) for _ in moe_layers(model)],
             3e-3 * (0.5 + 0.5 * i)) for i in range(n)]


def load(model, opt, grads, router_inputs, lr, static_inputs=None):
    """Copy one step's data in place: gradients, lrs (fill_) and, for the graph, its router inputs."""
    for p, grad in zip(model.parameters(), grads):
        p.grad.copy_(grad)
    for group in opt.param_groups:
        group["lr"].fill_(lr)
    for static, x in zip(static_inputs or [], router_inputs):
        static.copy_(x)


def train_step(model, opt, router_inputs, rule):
    """What the graph holds: the gates' training forwards (they record scores and loads), the
    optimizer step, the per-layer peak load, the balance update."""
    for moe, x in zip(moe_layers(model).values(), router_inputs):
        moe.gate(x)
    opt.step()
    peaks = max_load(model)
    balance_step(model, rule)
    return peaks


def snapshot(model, opt):
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"bias {n}": b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    for i, (p, state) in enumerate(opt.state.items()):
        out.update({f"state {i} {k}": v.clone() for k, v in state.items()})
    return out


@pytest.mark.parametrize("rule", ["quantile", "histogram"])
def test_graph_replay_equals_eager_steps(rule):
    model, opt = setup()
    ref, ref_opt = setup()
    warm, steps = batches(model, 1, seed=1)[0], batches(model, 3, seed=2)
    # warm up (cuBLAS handles, lazy inits) on a side stream, as torch.cuda.graphs asks; the same step eagerly on ref
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load(model, opt, *warm)
        train_step(model, opt, warm[1], rule)
    torch.cuda.current_stream().wait_stream(side)
    load(ref, ref_opt, *warm)
    train_step(ref, ref_opt, warm[1], rule)

    static_inputs = [torch.zeros_like(x) for x in warm[1]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_peaks = train_step(model, opt, static_inputs, rule)
    for grads, router_inputs, lr in steps:
        load(model, opt, grads, router_inputs, lr, static_inputs)
        graph.replay()
        load(ref, ref_opt, grads, router_inputs, lr)
        peaks = train_step(ref, ref_opt, router_inputs, rule)
        assert_rel_close("max_load", peaks, static_peaks, EXACT)
    torch.cuda.synchronize()
    got, want = snapshot(model, opt), snapshot(ref, ref_opt)
    assert got.keys() == want.keys()
    for name in want:
        assert_rel_close(name, want[name], got[name], EXACT)
    assert float(next(s["step"] for s in opt.state.values() if "step" in s)) == 4.0  # warm-up + 3 replays


def test_eager_step_never_synchronizes():
    model, opt = setup()
    grads, router_inputs, lr = batches(model, 1, seed=3)[0]
    load(model, opt, grads, router_inputs, lr)
    train_step(model, opt, router_inputs, "histogram")  # first call: lazy initialisation may sync
    load(model, opt, grads, router_inputs, lr)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for rule in ("quantile", "histogram", "sign"):
            train_step(model, opt, router_inputs, rule)
    finally:
        torch.cuda.set_sync_debug_mode("default")
