"""Packed serving steps on static buckets (k3/serve/packed_graph.py), on CPU: the host-free body a
CUDA graph captures, run eagerly, gives the engine the plain packed forward's tokens and logits
for prompts chunked across steps, mixed prefill + decode steps and requests that join mid-decode;
the buckets. The capture itself: tests/serve/test_packed_graph_gpu.py."""
from __future__ import annotations

import pytest
import torch

from k3.config import load_config
from k3.generation.generate import generate
from k3.model.transformer import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.packed_graph import PackedGraphs, bucket, packed_shape
from k3.serve.sampling import SamplingParams
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    """k3-tiny cut to 4 layers, KDA and MLA twice each: every kind of cached state."""
    torch.manual_seed(0)
    cfg = load_config("k3-tiny").replace(vocab_size=300, num_hidden_layers=4, kda_layers=[1, 3],
                                         full_attn_layers=[2, 4])
    return K3ForCausalLM(cfg).eval()


def test_buckets():
    assert [bucket(n) for n in (1, 5, 17, 100, 1000)] == [1, 6, 24, 128, 1024]
    s = packed_shape([1, 1, 1, 7, 30], [9, 40, 3, 0, 300], keep=4)
    assert (s.tokens, s.rows, s.decode_rows, s.chunk, s.columns, s.keep) == (48, 8, 2, 32, 512, 4)
    assert packed_shape([16], [0], 1).chunk == 16 and packed_shape([16], [0], 1).tokens == 24


@pytest.mark.parametrize("lengths", [(3, 17, 40, 9, 1), (30, 2, 1)])
def test_packed_steps_on_static_buckets_give_the_plain_tokens(model, lengths):
    """7 tokens a step: prompts chunked over steps, decode rows packed beside prompt chunks (the
    second set: behind a longer prompt's chunk, so the static rows reorder them)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 300, (n,), generator=g).tolist() for n in lengths]
    reference = generate(model, prompts, GREEDY.max_tokens)
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=7,
                                           max_num_seqs=3, enable_prefix_caching=False))
    packed = engine.runner.packed = PackedGraphs(model, capture=False)
    steps = []
    forward = packed.forward
    packed.forward = lambda ids, new, *a: steps.append(new) or forward(ids, new, *a)
    assert engine.generate(prompts, GREEDY) == reference
    assert packed.counts["eager"] == engine.runner.step_counts["packed"] == len(steps) > 3
    assert any(1 in new and max(new) > 1 for new in steps)  # decode rows beside a prompt chunk
    if lengths == (30, 2, 1):
        assert any(new.index(1) > 0 for new in steps if 1 in new and max(new) > 1)


def test_packed_step_logits_equal_the_plain_forward(model):
    """The first token's logprobs of each request, through the static buckets and without."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 300, (n,), generator=g).tolist() for n in (5, 12, 2)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = {}
    for name in ("plain", "static"):
        engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=64,
                                               enable_prefix_caching=False))
        if name == "static":
            engine.runner.packed = PackedGraphs(model, capture=False)
        requests = {engine.add_request(p, params).request_id: n for n, p in enumerate(prompts)}
        top = [None] * len(prompts)
        while engine.has_unfinished:
            for out in engine.step():
                for t in out.new_tokens:
                    top[requests[out.request_id]] = [lp for _, lp in t.top_logprobs]
        outs[name] = torch.tensor(top)
    torch.testing.assert_close(outs["static"], outs["plain"], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_static_step_equals_the_plain_cached_forward(model):
    """Decode rows behind prompt chunks (so the static rows reorder them), cached states and
    latents of other lengths: logits, KDA states and MLA rows as the plain packed forward leaves them."""
    from k3.model.cache import K3Cache, KDAState, MLAState

    cfg, g = model.config, torch.Generator().manual_seed(5)
    new, past = [3, 1, 4, 1], [5, 7, 0, 2]
    kda = [i for i in range(cfg.num_hidden_layers) if not cfg.is_mla_layer(i)]
    mla = [i for i in range(cfg.num_hidden_layers) if cfg.is_mla_layer(i)]
    empty = K3Cache.empty(cfg, len(new))
    conv = torch.randn(len(kda), *empty.layers[kda[0]].conv.shape, generator=g)
    recurrent = torch.randn(len(kda), *empty.layers[kda[0]].recurrent.shape, generator=g) * 0.3
    latents = torch.randn(len(new), 8, len(mla), cfg.mla_cache_width, generator=g)
    latents[torch.arange(8) >= torch.tensor(past)[:, None]] = 0  # rows past a length are zeros (the runner's)
    ids = torch.randint(6, 300, (sum(new),), generator=g)
    starts = [0, 3, 4, 8, 9]
    keep = [2, 3, 7, 8]
    layers: list = [None] * cfg.num_hidden_layers
    for j, i in enumerate(kda):
        layers[i] = KDAState(conv[j].clone(), recurrent[j].clone())
    for m, i in enumerate(mla):
        layers[i] = MLAState(latents[:, :, m].clone(), torch.tensor(past))
    plain = K3Cache(layers, torch.tensor(past))
    want = model(ids[None], cu_seqlens=torch.tensor(starts), cache=plain, logits_to_keep=torch.tensor(keep))[0]
    logits, static, rows = PackedGraphs(model, capture=False).forward(ids, new, past, conv, recurrent, latents, keep)
    assert rows == [2, 0, 3, 1]  # decode rows first
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    for i in kda:
        torch.testing.assert_close(static.layers[i].conv[rows], plain.layers[i].conv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(static.layers[i].recurrent[rows], plain.layers[i].recurrent, rtol=1e-5, atol=1e-6)
    for i in mla:
        for n, (p, k) in enumerate(zip(past, new)):
            torch.testing.assert_close(static.layers[i].buffer[rows[n], :p + k], plain.layers[i].buffer[n, :p + k])


def test_a_failing_static_step_falls_back_to_the_plain_forward(model, caplog):
    """A packed forward that fails on its static rows (say, a kernel the card lacks) has written no
    page yet: the step runs plainly, packed steps stay plain, and the tokens are unchanged."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 300, (n,), generator=g).tolist() for n in (9, 4)]
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=7,
                                           enable_prefix_caching=False))
    packed = engine.runner.packed = PackedGraphs(model, capture=False)
    packed._step = lambda static: 1 / 0
    with caplog.at_level("WARNING", logger="k3.serve.runner"):
        assert engine.generate(prompts, GREEDY) == generate(model, prompts, GREEDY.max_tokens)
    assert engine.runner.packed is None and "ZeroDivisionError" in caplog.text


def test_static_steps_with_prefix_hits_and_kda_checkpoints(model):
    """With the prefix cache on: a second wave of prompts sharing the first wave's prefixes starts
    from cached pages (KDA checkpoints copied in, MLA pages shared) and the static steps continue
    them; checkpoint copies after a step read the states the static rows wrote back."""
    g = torch.Generator().manual_seed(7)
    base = [torch.randint(6, 300, (n,), generator=g).tolist() for n in (20, 33)]
    second = [base[0] + [7, 8, 9], base[1][:24] + [11] * 5, base[0][:17]]
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=16,
                                           max_num_seqs=3))
    engine.runner.packed = PackedGraphs(model, capture=False)
    assert engine.generate(base, GREEDY) == generate(model, base, GREEDY.max_tokens)
    ids = {engine.add_request(p, GREEDY).request_id: n for n, p in enumerate(second)}
    tokens, cached = [[] for _ in second], [0] * len(second)
    while engine.has_unfinished:
        for out in engine.step():
            tokens[ids[out.request_id]] += [t.token_id for t in out.new_tokens]
            cached[ids[out.request_id]] = out.num_cached_tokens
    assert tokens == generate(model, second, GREEDY.max_tokens)
    assert cached[0] > 0, cached  # the first started from the cache (its KDA checkpoint, shared MLA pages)
    assert engine.runner.packed.counts["eager"] == engine.runner.step_counts["packed"]
