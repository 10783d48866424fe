"""Fused input projections (k3/model/fusion.py) against the same layers unfused, on CPU in fp32.

One GEMM over concatenated weights is not bit-exact with the separate GEMMs on the CPU BLAS (its
blocking follows the output width): a layer moved at most 2e-7 (RMSE ratio, 5 seeds, both mixers
and both KDA gate forms; MLA bit-exact at these widths), the whole model at its init 5.6e-7 (3
seeds, eight layers compound it). The bars are 1e-6 per layer and 2e-6 for the model."""
from __future__ import annotations

import copy
import logging
import tempfile

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from k3 import K3ForCausalLM
from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from tests.helpers import assert_rel_close
from tests.helpers.models import randomized, small_config
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)

LAYER_TOL, MODEL_TOL = 1e-6, 2e-6
FAMILIES = {"k3": {}, "kimi-linear": {"gate_lower_bound": None, "use_full_rank_gate": False, "q_lora_rank": None}}


def fused_copy(module: nn.Module) -> nn.Module:
    fused = copy.deepcopy(module)
    if hasattr(fused, "fuse_projections"):
        fused.fuse_projections()
    else:
        assert "fused" in fused.fuse_input_projections()
    return fused


def run_layer(layer, x, cu_seqlens=None, state=None):
    state = copy.deepcopy(state)
    with torch.no_grad():
        return layer(x, cu_seqlens=cu_seqlens, state=state), state


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_layer_fused_equals_unfused(family, kind):
    """Prefill, a decode step from a random state, and a packed row continuing a state."""
    cfg = small_config(**FAMILIES[family])
    torch.manual_seed(0)
    layer = (KimiDeltaAttention if kind == "kda" else GatedMLA)(cfg, 0).eval()
    fused = fused_copy(layer)
    D = cfg.hidden_size
    if kind == "kda":
        state = KDAState.empty(cfg, 3)
        state.conv.normal_()
        state.recurrent.normal_(0.0, 0.5)
    else:
        state = MLAState.empty(cfg, 3, capacity=32)
        state.buffer.normal_()
        state.lengths.fill_(5)
    cases = {"prefill": (torch.randn(2, 9, D), None, None), "decode": (torch.randn(3, 1, D), None, state),
             "packed": (torch.randn(1, 8, D), torch.tensor([0, 1, 6, 8]), state)}
    for name, (x, cu, st) in cases.items():
        (ref, ref_state), (out, out_state) = run_layer(layer, x, cu, st), run_layer(fused, x, cu, st)
        assert_rel_close(f"{kind} {family} {name}", ref, out, LAYER_TOL)
        if st is not None:
            for (n, a), b in zip(vars(ref_state).items(), vars(out_state).values(), strict=True):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    assert_rel_close(f"{kind} {family} {name} state.{n}", a, b, LAYER_TOL)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = randomized(K3ForCausalLM(small_config()))
    return model, fused_copy(model)


def test_model_fused_equals_unfused_prefill_packed_decode(models):
    model, fused = models
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    cu = torch.tensor([0, 5, 12])
    with torch.no_grad():
        assert_rel_close("prefill", model(ids), fused(ids), MODEL_TOL)
        assert_rel_close("packed", model(ids[:1], cu_seqlens=cu), fused(ids[:1], cu_seqlens=cu), MODEL_TOL)
        full = fused(ids)
        logits = {}
        for name, m in (("unfused", model), ("fused", fused)):
            cache = K3Cache.empty(m.config, 2)
            m(ids[:, :8], cache=cache)
            logits[name] = torch.cat([m(ids[:, t:t + 1], cache=cache) for t in range(8, 12)], dim=1)
    assert_rel_close("decode", logits["unfused"], logits["fused"], MODEL_TOL)
    assert_rel_close("fused decode = fused prefill", full[:, 8:], logits["fused"], 1e-5)  # test_model.py's bar


def test_names_values_and_memory_unchanged(models):
    model, fused = models
    ref, out = model.state_dict(), fused.state_dict()
    assert list(ref) == list(out)
    assert all(torch.equal(ref[k], out[k]) for k in ref)
    for layer in fused.model.layers:
        mixer = layer.self_attn
        matrix = mixer._fused.weight
        for name in mixer.input_projections():  # each weight is a row block of the one matrix: no second copy
            w = getattr(mixer, name).weight
            assert isinstance(w, nn.Parameter) and w.untyped_storage().data_ptr() == matrix.untyped_storage().data_ptr()
        assert matrix.untyped_storage().nbytes() == matrix.numel() * matrix.element_size()


def test_save_load_round_trip_and_in_place_load(models):
    model, fused = models
    with tempfile.TemporaryDirectory() as d:
        fused.save_pretrained(d)
        loaded = K3ForCausalLM.from_pretrained(d)
    ref, out = model.state_dict(), loaded.state_dict()
    assert list(ref) == list(out) and all(torch.equal(ref[k], out[k]) for k in ref)
    # an in-place load reaches the fused matrix: outputs follow the new weights
    other = fused_copy(model)
    torch.manual_seed(2)
    new = randomized(K3ForCausalLM(small_config()))
    other.load_state_dict(new.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        assert_rel_close("after load_state_dict", new(ids), other(ids), MODEL_TOL)


def test_autograd_and_replaced_parameters_run_unfused(models, caplog):
    """Training never takes the fused GEMM: gradients are the unfused model's bit for bit. A model
    whose Parameters were replaced (a deep copy) runs unfused, with one warning."""
    model, fused = models
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    grads = []
    for m in (model, fused):
        m.zero_grad()
        m(ids).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    copied = copy.deepcopy(fused)
    with caplog.at_level(logging.WARNING, logger="k3.model.fusion"), torch.no_grad():
        assert torch.equal(copied(ids), model(ids))
    assert any("no longer share" in r.getMessage() for r in caplog.records)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def test_decode_step_runs_fewer_gemms(models):
    """A decode step's matrix products: per KDA layer 6 projections of x become 1, per MLA layer 3."""
    model, fused = models
    counts = []
    for m in (model, fused):
        cache = K3Cache.empty(m.config, 2)
        with torch.no_grad():
            m(torch.zeros(2, 3, dtype=torch.long), cache=cache)
            with CountMatmuls() as mode:
                m(torch.zeros(2, 1, dtype=torch.long), cache=cache)
        counts.append(mode.count)
    cfg = model.config
    kda = sum(not cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    mla = cfg.num_hidden_layers - kda
    assert counts[0] - counts[1] == 5 * kda + 2 * mla, counts


def test_unfusable_projections_stay_separate():
    cfg = small_config()
    layer = KimiDeltaAttention(cfg, 0)
    layer.b_proj = nn.Linear(cfg.hidden_size, cfg.kda_num_heads, bias=True)
    assert layer.fuse_input_projections() == "KDA kept unfused (a projection has a bias)"
    assert layer._fused is None
    mla = GatedMLA(cfg, 0)
    mla.g_proj = type("QuantizedLinear", (nn.Linear,), {})(cfg.hidden_size, mla.g_proj.out_features, bias=False)
    assert "not a plain nn.Linear" in mla.fuse_input_projections() and mla._fused is None
