"""Host synchronizations of the engine's steady decode steps on CUDA (`-m gpu`): a decode step
replayed from its graph reads back only the sampled tokens, one synchronization per step, counted
by torch's sync debug mode (it warns at every synchronizing call)."""
from __future__ import annotations

import warnings

import pytest
import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.serve.decode_graph import capturable_experts
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_steady_decode_step_synchronizes_once(temperature):
    torch.manual_seed(0)
    cfg = load_config("k3-tiny").replace(vocab_size=300, num_hidden_layers=4, kda_layers=[1, 3],
                                         full_attn_layers=[2, 4])
    model = K3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    if not capturable_experts(model):
        pytest.skip("routed experts without torch._grouped_mm (bf16 on sm90+): decode steps are not captured")
    engine = LLMEngine(model, EngineConfig(max_num_seqs=8, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=1, ignore_eos=True)
    for n in range(8):
        engine.add_request(torch.randint(6, 300, (12 + n,)).tolist(), params)
    for _ in range(12):  # prefill, then decode steps until every graph shape is captured
        engine.step()
    counts = engine.runner.step_counts
    syncs = []
    for _ in range(8):
        replays = counts["decode_graph_replay"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert counts["decode_graph_replay"] == replays + 1  # a steady step: the graph replayed
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    assert max(syncs) <= 1, (syncs, [str(w.message) for w in caught][:5])
