"""Regional compilation (k3/regional_compile.py) traces every mixer and FFN kind and changes nothing.

Traced with the "eager" backend (dynamo only): it checks that the graphs capture and agree, in
seconds; inductor's code generation is exercised on the GPU (bench/gpu_bench.py, train).
"""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.regional_compile import compile_regions
from tests.helpers import assert_rel_close, recompile_limit_hits


def _loss_and_grads(model, ids):
    loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_compiled_regions_match_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny")).train()
    compiled = copy.deepcopy(model)
    regions = compile_regions(compiled, backend="eager")
    assert len(regions) == 4 * model.config.num_hidden_layers + 1  # norm, mixer, norm, FFN; final norm
    ids = torch.randint(0, model.config.vocab_size, (2, 33))
    loss_ref, grads_ref = _loss_and_grads(model, ids)
    loss, grads = _loss_and_grads(compiled, ids)
    assert_rel_close("loss", loss_ref, loss, 1e-6)
    assert len(grads) == len(grads_ref)
    for g_ref, g in zip(grads_ref, grads):
        assert_rel_close("grad", g_ref, g, 1e-5)


@pytest.mark.slow  # ~6 s of tracing; the default run decodes through traced regions in tests/serve/test_engine.py
def test_compiled_regions_decode_in_place():
    """Decode writes the cache in place (MLA rows, KDA states); traced regions must keep doing so."""
    from k3.model.cache import K3Cache

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny")).eval()
    compiled = copy.deepcopy(model)
    compile_regions(compiled, backend="eager")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    outs = []
    with torch.no_grad():
        for m in (model, compiled):
            cache = K3Cache.empty(m.config, 2)
            m(ids[:, :8], cache=cache)
            outs.append(torch.cat([m(ids[:, t:t + 1], cache=cache) for t in range(8, 12)], 1))
    assert_rel_close("decode logits", outs[0], outs[1], 1e-5)


@pytest.mark.slow  # a cold inductor cache compiles for minutes on 2 cores
def test_compiled_attn_res_reads_never_fall_back_to_eager(caplog):
    """The shared compiled read is traced per source count, grad mode and kind of length (training,
    prefills of two lengths, decode steps); the recompile limit must cover them all, or later
    reads silently run eager."""
    from k3.model.cache import K3Cache

    torch._dynamo.reset()
    model = K3ForCausalLM(load_config("k3-tiny").replace(attn_res_block_size=1)).train()  # 8 blocks, as K3
    compile_regions(model, backend="eager")
    assert model.model.attn_res_read is model.model.layers[0].attn_res_read
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        model(ids).sum().backward()
        model(ids[:, :7]).sum().backward()
        with torch.no_grad():
            model(ids)
            cache = K3Cache.empty(model.config, 1)
            model(ids[:, :6], cache=cache)
            for t in range(6, 9):
                model(ids[:, t:t + 1], cache=cache)
    hits = recompile_limit_hits(caplog)
    assert not [m for m in hits if "attn_res_read" in m], hits


def test_training_steps_trace_once():
    """After the first step, training steps replay what was traced, with or without balance_step
    between them (the router's records for it are kept outside the traced graph): a traced list
    append made every step, and every micro-batch, a new MoE graph."""
    from torch._dynamo.utils import counters

    from k3.train.balance import balance_step

    torch._dynamo.reset()
    model = K3ForCausalLM(load_config("k3-tiny")).train()
    compile_regions(model, backend="eager")
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    model(ids).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):  # micro-batches of one step: records accumulate
        model(ids).sum().backward()
    balance_step(model, "quantile")
    model(ids).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiling_twice_keeps_the_compiled_regions():
    model = K3ForCausalLM(load_config("k3-tiny"))
    first = compile_regions(model, backend="eager")
    wrapped = [m._compiled_call_impl for m in first]
    read = model.model.attn_res_read
    assert compile_regions(model, backend="eager") == first
    assert [m._compiled_call_impl for m in first] == wrapped and model.model.attn_res_read is read


def test_unknown_backend_is_refused_before_any_forward():
    model = K3ForCausalLM(load_config("k3-tiny"))
    with pytest.raises(ValueError, match="unknown torch.compile backend 'inductr'"):
        compile_regions(model, backend="inductr")
