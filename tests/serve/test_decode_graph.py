"""CUDA-graph decode (k3/serve/decode_graph.py): what it refuses, with a message that says why;
on CUDA (`-m gpu`), decode steps replayed from graphs against eager steps and against the CPU fp32
reference (with and without compiled regions), and the serving engine's graph replay against its
eager steps."""
import copy
import gc

import pytest
import torch

from k3.config import load_config
from k3.model.cache import K3Cache
from k3.model.transformer import K3ForCausalLM
from k3.regional_compile import compile_regions
from k3.serve.decode_graph import CUDAGraphDecoder, capturable_experts
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from tests.helpers import assert_rel_close
from tests.helpers.gpu import EXACT, bf16_reference, dense_routing_model, model_bound


def test_refuses_cpu_models_and_host_synchronizing_experts():
    model = K3ForCausalLM(load_config("k3-tiny")).eval()
    assert not capturable_experts(model)  # CPU: the per-expert loop reads counts on the host
    with pytest.raises(ValueError, match="CUDA"):
        CUDAGraphDecoder(model, K3Cache.empty(model.config, 1, capacity=8))


@torch.no_grad()
def graph_decode(m: K3ForCausalLM, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits [B, steps, V] of the last `steps` tokens of ids [B, T]: a prefill of the rest into a
    cache, then one decode step per token replayed from a CUDA graph."""
    B, T = ids.shape
    cache = K3Cache.empty(m.config, B, device=ids.device, dtype=next(m.parameters()).dtype, capacity=T)
    m(ids[:, :-steps], cache=cache)
    decoder = CUDAGraphDecoder(m, cache)
    return torch.stack([decoder.step(ids[:, t]).clone() for t in range(T - steps, T)], 1)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-regions", "compiled-regions"])
def test_graph_decode_matches_eager_decode_and_reference(compiled, B=2, T=200, steps=4):
    """bf16 on CUDA: a prefill of T-4 tokens, then 4 decode steps replayed from a CUDA graph give
    the last 4 logits of the fp32 reference of the same rounded weights, within the model's bf16
    bound (tests/helpers/gpu.py). Uncompiled, the replay equals the eager steps exactly. With its
    regions compiled by inductor (k3.regional_compile, as `k3 serve --compile` runs the model), the
    bf16 arithmetic is fused and reordered, so not bit-equal to eager: prefill and replay must be
    as close to the reference."""
    model = dense_routing_model()
    m = copy.deepcopy(model).to("cuda", torch.bfloat16)
    if not capturable_experts(m):
        pytest.skip("routed experts not capturable on this GPU (grouped_mm needs sm90)")
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    reference, floor = bf16_reference(model, ids)
    reference, bound = reference[:, -steps:], model_bound(floor)
    ids = ids.cuda()
    if compiled:
        compile_regions(m)
        with torch.no_grad():
            full = m(ids)[:, -steps:].cpu()
        assert_rel_close(f"compiled prefill vs cpu fp32 (cpu bf16: {floor:.1e})", reference, full, bound)
    graphed = graph_decode(m, ids, steps).cpu()
    assert_rel_close(f"graph decode vs cpu fp32 (cpu bf16: {floor:.1e})", reference, graphed, bound)
    if not compiled:
        with torch.no_grad():
            cache = K3Cache.empty(m.config, B, device="cuda", dtype=torch.bfloat16)
            m(ids[:, :-steps], cache=cache)
            eager = torch.cat([m(ids[:, t:t + 1], cache=cache) for t in range(T - steps, T)], 1).cpu()
        assert_rel_close("graph decode = eager decode", eager, graphed, EXACT)


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
    pool PyTorch retired with the old ones (else the caching allocator's internal assert at
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
