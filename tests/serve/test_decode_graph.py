"""CUDA-graph decode (k3/serve/decode_graph.py): what it refuses, with a message that says why;
on CUDA, the serving engine's graph replay against its eager steps. The model-level numerics are
checked on the GPU by bench/gpu_checks.py (model decode)."""
import gc

import pytest
import torch

from k3.config import load_config
from k3.model.cache import K3Cache
from k3.model.transformer import K3ForCausalLM
from k3.serve.decode_graph import CUDAGraphDecoder, capturable_experts
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams


def test_refuses_cpu_models_and_host_synchronizing_experts():
    model = K3ForCausalLM(load_config("k3-tiny")).eval()
    assert not capturable_experts(model)  # CPU: the per-expert loop reads counts on the host
    with pytest.raises(ValueError, match="CUDA"):
        CUDAGraphDecoder(model, K3Cache.empty(model.config, 1, capacity=8))


@pytest.mark.gpu
def test_engine_replays_decode_graphs_with_the_eager_tokens():
    """On CUDA (bf16, grouped_mm experts): the engine's decode steps replayed from CUDA graphs
    give the tokens of eager steps, through a batch that shrinks as requests finish."""
    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny")).eval().to("cuda", torch.bfloat16)
    if not capturable_experts(model):
        pytest.skip("routed experts not capturable on this GPU (grouped_mm needs sm90)")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 300)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 30, 60)]
    runs = {}
    for graphs in (False, True):
        engine = LLMEngine(model, EngineConfig(cuda_graphs=graphs))
        requests = [engine.add_request(p, s) for p, s in zip(prompts, params)]
        while engine.has_unfinished:
            engine.step()
        runs[graphs] = [r.output_token_ids for r in requests], engine.runner.step_counts
    assert runs[True][0] == runs[False][0]
    eager, replayed = runs[False][1], runs[True][1]
    assert eager["decode_graph_capture"] == 0 and eager["decode_eager"] > 0
    # one capture per slot shape: 4 rows (3 requests), 2, then 1; 256 latent columns, then 512
    assert replayed["decode_eager"] == 0 and replayed["decode_graph_capture"] >= 3
    assert replayed["decode_graph_replay"] > 5 * replayed["decode_graph_capture"]


@pytest.mark.gpu
def test_decode_slots_capture_again_after_growing():
    """Growing the slots drops their graphs; the graphs captured next must not go into the memory
    pool PyTorch retired with the old ones (run 24: an internal assert of the caching allocator at
    capture_begin, "use_count > 0")."""
    from k3.serve.decode_slots import DecodeSlots

    model = K3ForCausalLM(load_config("k3-tiny")).eval().to("cuda", torch.bfloat16)
    if not capturable_experts(model):
        pytest.skip("routed experts not capturable on this GPU (grouped_mm needs sm90)")
    slots = DecodeSlots(model, cuda_graphs=True)
    kinds = []
    for requests, tokens in ((1, 10), (2, 300), (4, 700)):  # every shape larger than the last: growth
        shape = slots.shape_for(requests, tokens)
        assert slots.reserve(*shape)
        gc.collect()  # the dropped graphs are gone before the next capture
        ids = torch.arange(7, 7 + requests, device="cuda")
        kinds += [slots.step(ids, shape)[1] for _ in range(2)]
    assert kinds == ["graph_capture", "graph_replay"] * 3
