"""A capturable optimizer step and balance update (DESIGN §8, §6): tensor learning rates filled in
place by the schedule, no host read inside `PerHeadMuon.step()` or `balance_step`, bit-identical
histograms, and checkpoints that resume across modes. The CUDA-graph replay is
tests/train/test_capturable_optimizer_gpu.py (`-m gpu`)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.optim import adam as torch_adam

from k3.checkpoint import training_state as ckpt
from k3.config import load_config
from k3.model.moe import StableLatentMoE
from k3.model.transformer import K3ForCausalLM
from k3.train.balance import (
    balance_step,
    expert_loads,
    histogram_balance,
    margin_edges,
    margin_histogram,
    max_load,
    qb_margins,
    quantile_from_histogram,
)
from k3.train.muon import PerHeadMuon, param_groups
from k3.train.schedule import warmup_cosine
from tests.helpers import assert_rel_close

HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__")


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Every Python-level read of a tensor's value raises while the block runs (a CUDA sync there)."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("a host read of a tensor inside a capturable step")

    with monkeypatch.context() as m:
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, refuse)
        yield


@pytest.fixture
def cpu_capturable(monkeypatch):
    """torch's capturable AdamW refuses CPU tensors by a device list, not by its math: admitting
    the CPU runs here the exact AdamW path a CUDA graph captures."""
    devices = torch_adam._get_capturable_supported_devices
    monkeypatch.setattr(torch_adam, "_get_capturable_supported_devices", lambda *a, **k: [*devices(*a, **k), "cpu"])


SHAPES = ((32, 24), (32, 24), (4, 16, 8), (8, 8), (16, 4), (4,))


def tiny_groups(ps: list[nn.Parameter]) -> list[dict]:
    """Muon head blocks, a stacked expert bank (batched NS), whole matrices, AdamW with and without decay."""
    return [{"name": "m_rows", "kind": "muon", "params": ps[:2], "block_axis": 0, "block_size": 8},
            {"name": "m_whole", "kind": "muon", "params": ps[2:4]},
            {"name": "a_decay", "kind": "adamw", "params": ps[4:5]},
            {"name": "a_none", "kind": "adamw", "params": ps[5:], "weight_decay": 0.0}]


def test_capturable_step_matches_eager_with_no_host_read(monkeypatch, cpu_capturable):
    ps = [nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    ps_ref = [nn.Parameter(p.detach().clone()) for p in ps]
    opt = PerHeadMuon(tiny_groups(ps), lr=0.02, weight_decay=0.1, capturable=True)
    ref = PerHeadMuon(tiny_groups(ps_ref), lr=0.02, weight_decay=0.1)
    sched, sched_ref = warmup_cosine(opt, 10), warmup_cosine(ref, 10)
    lr_tensors = [g["lr"] for g in opt.param_groups]
    assert all(t.dtype == torch.float32 and t.dim() == 0 for t in lr_tensors)
    for _ in range(3):
        for p, q in zip(ps, ps_ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ps[3].grad = None  # a parameter without a gradient is skipped in both modes
        ps_ref[3].grad = None
        with no_host_reads(monkeypatch):
            opt.step()
        ref.step()
        sched.step()
        sched_ref.step()
        # the schedule fills the same tensors (a graph keeps reading them) and logs floats
        assert [g["lr"] for g in opt.param_groups] == lr_tensors
        assert sched.get_last_lr() == sched_ref.get_last_lr() and isinstance(sched.get_last_lr()[0], float)
        assert float(lr_tensors[0]) == torch.tensor(sched_ref.get_last_lr()[0], dtype=torch.float32).item()
    for p, q in zip(ps, ps_ref):
        assert_rel_close("capturable vs eager", q.detach(), p.detach(), 1e-6)  # fp32 vs double lr arithmetic
    assert torch.equal(opt.state[ps[4]]["step"], torch.tensor(3.0))
    with pytest.raises(AssertionError, match="host read"), no_host_reads(monkeypatch):
        float(lr_tensors[0])  # the guard itself works


def moe_pair() -> nn.Module:
    cfg = load_config("k3-tiny").replace(hidden_size=32, routed_expert_hidden_size=16, num_experts=8,
                                         num_experts_per_token=2, moe_intermediate_size=16)
    return nn.ModuleDict({"a": StableLatentMoE(cfg), "b": StableLatentMoE(cfg)}).train()


@pytest.mark.parametrize("rule", ["quantile", "histogram", "sign"])
def test_balance_step_and_max_load_read_nothing_back(rule, monkeypatch):
    model = moe_pair()
    with torch.no_grad():
        model["a"].gate.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(3, 40, 32)
    for layer in model.values():
        layer(x)
    twin = copy.deepcopy(model)
    loads = expert_loads(model)
    expected_max = torch.stack([(v.max() / v.float().mean()).float() for v in loads.values()])
    reduce_fn = None if rule == "quantile" else (lambda t: t * 2)  # an all-reduce over two ranks
    with no_host_reads(monkeypatch):
        peaks = max_load(model)
        balance_step(model, rule, reduce_fn=reduce_fn)
    assert torch.equal(peaks, expected_max) and max_load(model) is None  # consumed with the records
    # the same update as the host-reading reference: int q, bincount histogram
    for name, layer in twin.items():
        gate = layer.gate
        if rule == "histogram":
            edges = margin_edges()
            margins = qb_margins(gate.last_scores, gate.e_score_correction_bias, 2)
            which = torch.bucketize(margins, edges[1:-1], right=True) + torch.arange(8) * 1000
            counts = torch.bincount(which.flatten(), minlength=8 * 1000).view(8, 1000) * 2
            assert torch.equal(counts, margin_histogram(gate.last_scores, gate.e_score_correction_bias, 2, edges) * 2)
            m = 2 * gate.last_scores.shape[0]
            quantiles = quantile_from_histogram(counts, edges, m * 2 // 8)
            expected = -quantiles - (-quantiles).mean()
            assert torch.equal(histogram_balance(counts, edges, 2), expected)
            assert torch.equal(model[name].gate.e_score_correction_bias, expected)
    balance_step(twin, rule, reduce_fn=reduce_fn)
    for name in model:
        assert torch.equal(model[name].gate.e_score_correction_bias, twin[name].gate.e_score_correction_bias)


def _tiny_model(seed: int, capturable: bool):
    cfg = load_config("k3-tiny").replace(vocab_size=64, hidden_size=32, num_hidden_layers=2, kda_layers=[],
                                         full_attn_layers=[], intermediate_size=48, num_experts=4,
                                         moe_intermediate_size=16, routed_expert_hidden_size=16)
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg)
    opt = PerHeadMuon(param_groups(model, cfg, weight_decay=0.1), lr=3e-3, capturable=capturable)
    return model, opt, warmup_cosine(opt, 20)


def _step(model, opt, sched, ids):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:]).backward()
    opt.step()
    sched.step()


@pytest.mark.parametrize("saved_capturable", [True, False])
def test_checkpoint_resumes_across_modes(saved_capturable, tmp_path, cpu_capturable):
    """Float lrs in the files either way; a capturable optimizer loads them into its own lr tensors
    (a captured graph keeps reading them) and its AdamW steps onto the parameters' device."""
    ids = torch.randint(0, 64, (1, 17))
    model, opt, sched = _tiny_model(0, saved_capturable)
    _step(model, opt, sched, ids)
    folder = ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, {}, lambda d: None, keep=1)
    saved_lrs = [float(g["lr"]) for g in opt.param_groups]
    saved_state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    for _ in range(2):
        _step(model, opt, sched, ids)
    for capturable in (True, False):
        model2, opt2, sched2 = _tiny_model(1, capturable)  # another init: everything comes from the files
        lr_tensors = [g["lr"] for g in opt2.param_groups]
        ckpt.load_checkpoint(folder, model2, opt2, sched2)
        for g, lr, t in zip(opt2.param_groups, saved_lrs, lr_tensors):
            assert (g["lr"] is t and torch.equal(t, torch.tensor(lr))) if capturable else g["lr"] == lr
        for state, p2 in zip(saved_state, model2.parameters()):
            for key, value in state.items():
                restored = opt2.state[p2][key]
                assert torch.equal(value, restored), key
                assert restored.device == p2.device and restored.dtype == value.dtype
        for _ in range(2):
            _step(model2, opt2, sched2, ids)
        assert sched2.get_last_lr() == sched.get_last_lr()
        for p, p2 in zip(model.parameters(), model2.parameters()):
            if capturable == saved_capturable:  # the same mode continues bit for bit
                assert torch.equal(p, p2)
            else:  # fp32 lr tensors against double lr floats in Muon's decay and update
                assert_rel_close("cross-mode resume", p.detach(), p2.detach(), 1e-6)
