"""Packed serving steps captured as CUDA graphs (k3/serve/packed_graph.py) on CUDA in bf16: a
shape's replay on other requests' data equals the same host-free step run eagerly, and the engine
with captured packed steps gives the tokens of the engine running them eagerly. `-m gpu`; the CPU
side is tests/serve/test_packed_graph.py."""
from __future__ import annotations

import pytest
import torch

from k3.config import load_config
from k3.model.cache import K3Cache
from k3.model.transformer import K3ForCausalLM
from k3.ops import fla_kernels
from k3.serve.decode_graph import capturable_experts
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.packed_graph import PackedGraphs
from k3.serve.sampling import SamplingParams
from tests.helpers.gpu import side_stream, unit_scale_  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_kernels.available(), reason="needs fla-core with triton"),
              pytest.mark.usefixtures("side_stream")]


def tiny():
    torch.manual_seed(0)
    cfg = load_config("k3-tiny").replace(vocab_size=300, num_hidden_layers=4, kda_layers=[1, 3],
                                         full_attn_layers=[2, 4])
    model = unit_scale_(K3ForCausalLM(cfg)).to("cuda", torch.bfloat16).eval()
    if not capturable_experts(model):
        pytest.skip("routed experts without torch._grouped_mm (bf16 on sm90+) cannot be captured")
    return model


def states(model, new, past, seed):
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    kda = sum(not cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    empty = K3Cache.empty(cfg, len(new))
    kda_i = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_mla_layer(i))
    conv = torch.randn(kda, *empty.layers[kda_i].conv.shape, generator=g).to("cuda", torch.bfloat16)
    recurrent = (torch.randn(kda, *empty.layers[kda_i].recurrent.shape, generator=g) * 0.3).cuda()
    latents = torch.randn(len(new), 64, cfg.num_mla_layers, cfg.mla_cache_width, generator=g)
    latents[torch.arange(64) >= torch.tensor(past)[:, None]] = 0
    ids = torch.randint(6, 300, (sum(new),), generator=g).cuda()
    return ids, conv, recurrent, latents.to("cuda", torch.bfloat16)


@torch.no_grad()
def test_replay_on_other_requests_equals_eager():
    model = tiny()
    captured, eager = PackedGraphs(model), PackedGraphs(model, capture=False)
    new, past = [3, 1, 4, 1], [5, 7, 0, 2]  # the same shape three times, other data each time
    for seed in range(3):
        inputs = states(model, new, past, seed)
        a, ca, rows = captured.forward(inputs[0], new, past, *inputs[1:], [2, 3, 7, 8])
        b, cb, _ = eager.forward(inputs[0], new, past, *inputs[1:], [2, 3, 7, 8])
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for la, lb in zip(ca.layers, cb.layers):
            for ta, tb in zip(vars(la).values(), vars(lb).values()):
                if isinstance(ta, torch.Tensor):
                    torch.testing.assert_close(ta[rows], tb[rows], rtol=0, atol=0)
    assert captured.counts == {"eager": 1, "capture": 1, "replay": 1}, captured.capture_error


@torch.no_grad()
def test_engine_with_captured_packed_steps_gives_the_eager_steps_tokens():
    model = tiny()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 300, (n,), generator=g).tolist() for n in (30, 2, 1, 17, 40, 9)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for capture in (True, False):
        engine = LLMEngine(model, EngineConfig(block_size=16, max_num_batched_tokens=24, max_num_seqs=4,
                                               enable_prefix_caching=False, packed_graphs=True))
        assert engine.runner.packed is not None
        engine.runner.packed.capture = capture
        outs[capture] = engine.generate(prompts, params)
        if capture:
            assert engine.runner.packed.counts["replay"] > 0, engine.runner.packed.capture_error
    assert outs[True] == outs[False]
