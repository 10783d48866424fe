"""The engine fuses each mixer's input projections at load (k3/model/fusion.py, on by default) and
gives the same greedy tokens as without (`--no-fuse-projections`), prefix hits and chunked
prefill included, with one log line naming what it fused."""
from __future__ import annotations

import argparse
import copy
import logging

import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)


def test_fused_engine_gives_the_same_greedy_tokens(caplog):
    torch.manual_seed(0)
    cfg = load_config("k3-tiny").replace(vocab_size=300, num_hidden_layers=4, kda_layers=[1, 3],
                                         full_attn_layers=[2, 4])
    model = K3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 300, (n,), generator=g).tolist() for n in (3, 17, 30)]
    prompts.append(prompts[2][:24] + prompts[0])  # a prefix hit
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for fuse in (False, True):
        config = EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=16, fuse_projections=fuse)
        with caplog.at_level(logging.INFO, logger="k3.serve.engine"):
            engine = LLMEngine(copy.deepcopy(model), config)
        outputs[fuse] = engine.generate(prompts, greedy)
        mixers = [layer.self_attn for layer in engine.model.model.layers]
        assert all((m._fused is not None) == fuse for m in mixers)
    assert outputs[True] == outputs[False]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fused input projections")]
    assert len(lines) == 1 and "KDA q|k|v|b|f_a|g fused" in lines[0] and "layers 0, 2" in lines[0], lines


def test_no_fuse_projections_flag():
    from k3.serve.cli import add_arguments, engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert engine_config(p.parse_args(["--run", "r"])).fuse_projections
    assert not engine_config(p.parse_args(["--run", "r", "--no-fuse-projections"])).fuse_projections
