"""The engine with the real k3-tiny model at random init: greedy outputs equal the model's own
`generate` for any prefix-cache setting, batch composition and chunked-prefill size, with decode
steps reusing the previous step's cache; requests leaving and joining mid-decode change nobody
else's tokens, and a replaced cache is freed; the decode-graph bookkeeping (capture, replay,
recapture when the batch changes or its MLA buffers fill) is exact, with the graph stood in for
on CPU; short prompts hit on resend; a 10-turn chat reuses its previous turns."""
from __future__ import annotations

import copy
import dataclasses
import logging
import weakref

import pytest
import torch

from k3.config import load_config
from k3.model import cache as cache_module
from k3.model.cache import KDAState, MLAState
from k3.model.decode_graph import _restore, _snapshot
from k3.model.generate import generate
from k3.model.transformer import K3ForCausalLM
from k3.serve.chat_format import ChatFormat
from k3.serve import runner as runner_module
from k3.serve.runner import STEP_KINDS
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.train.tokenizer import train_tokenizer
from tests.conftest import recompile_limit_hits
from tests.serve_fakes import one_torch_thread  # noqa: F401 (autouse fixture)

CORPUS = ["The quick brown fox jumps over the lazy dog.", "To be, or not to be, that is the question.",
          "Serving hybrid models needs prefix caching that works.", "hello world " * 3]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS * 4, 320)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    cfg = load_config("k3-tiny").replace(vocab_size=tokenizer.get_vocab_size())
    return K3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompts(model):
    g = torch.Generator().manual_seed(1)
    lengths = [3, 17, 40, 9]
    prompts = [torch.randint(6, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[2][:30] + prompts[0])  # shares a prefix with the third
    return prompts


@pytest.fixture(scope="module")
def reference(model, prompts):
    return generate(model, prompts, 4)


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def track_cache_builds(engine: LLMEngine) -> tuple[list[weakref.ref], dict[str, int]]:
    """Weak references to every K3Cache the runner builds from pages, and a count of the steps
    that ran a forward: fewer builds than steps means decode steps reused the resident cache."""
    built, counts = [], {"steps": 0}
    runner = engine.runner
    build_cache, execute = runner.build_cache, runner.execute

    def tracked_build(requests):
        cache = build_cache(requests)
        built.append(weakref.ref(cache))
        return cache

    def counted_execute(out, params):
        counts["steps"] += bool(out.requests)
        return execute(out, params)

    runner.build_cache, runner.execute = tracked_build, counted_execute
    return built, counts


@pytest.mark.parametrize("prefix_caching,budget,max_seqs", [
    (True, 256, 8), (True, 5, 8), (False, 7, 8), (True, 16, 1)],
    ids=["cache-whole", "cache-chunk5", "nocache-chunk7", "cache-chunk16-seqs1"])
def test_greedy_matches_generate(model, prompts, reference, prefix_caching, budget, max_seqs):
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=budget,
                                           max_num_seqs=max_seqs, enable_prefix_caching=prefix_caching))
    built, counts = track_cache_builds(engine)
    assert engine.generate(prompts, GREEDY) == reference
    assert len(built) < counts["steps"]  # decode steps ran on the resident cache
    # again, now from the prefix cache, and in another batch composition
    order = [4, 1, 3, 0, 2]
    assert engine.generate([prompts[i] for i in order], GREEDY) == [reference[i] for i in order]
    if prefix_caching:
        assert engine.cache.stats.hit_tokens > 0
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_compiled_regions_change_no_token(model, prompts, reference, caplog):
    """EngineConfig.compile traces the norms, mixers, FFNs and AttnRes reads (the eager backend keeps
    this fast on CPU: what is checked is that serving through dynamo's graphs, prefill and decode,
    with every batch shape the scheduler makes, yields the same tokens, and that no region exhausts
    its recompiles and silently falls back to eager)."""
    engine = LLMEngine(copy.deepcopy(model), EngineConfig(block_size=4, hash_block_size=8, compile="eager"))
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        assert engine.generate(prompts, GREEDY) == reference
    assert not recompile_limit_hits(caplog)


def test_requests_leaving_and_joining_mid_decode_keep_every_output_exact(model, prompts):
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8))
    built, counts = track_cache_builds(engine)

    def greedy(n: int) -> SamplingParams:
        return dataclasses.replace(GREEDY, max_tokens=n)

    # the prefill stops one token short (a KDA checkpoint at prompt_len - 1): token k comes at step k + 1
    stays = engine.add_request(prompts[0], greedy(8))
    finishes = engine.add_request(prompts[1], greedy(3))  # at step 4
    cancelled = engine.add_request(prompts[3], greedy(8))  # after step 6
    while engine.has_unfinished:
        engine.step()
        if counts["steps"] == 4:  # takes the finished one's place: a prefix hit, one token to compute
            joins = engine.add_request(prompts[1], greedy(5))
        if counts["steps"] == 6:
            engine.abort(cancelled.request_id)
        # only the cache of the current set of requests may be alive: a replaced one is freed at once
        assert not any(ref() is not None for ref in built[:-1])
    assert built[-1]() is None  # and once idle, that one too
    assert joins.num_cached_tokens == len(prompts[1]) - 1
    # built for steps 1 (prefill), 5 (one left, one joined) and 7 (after the cancellation); the others reused
    assert (counts["steps"], len(built)) == (9, 3)
    for request, prompt, n in [(stays, 0, 8), (finishes, 1, 3), (joins, 1, 5)]:
        assert request.output_token_ids == generate(model, [prompts[prompt]], n)[0]
    assert cancelled.output_token_ids == generate(model, [prompts[3]], 8)[0][:5]
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


class StandInGraph:
    """CUDAGraphDecoder's contract on CPU: a warm-up step that the cache is restored from, then
    each step runs on exactly the tensors seen at capture (a real graph would read and write those
    addresses whatever the cache held later; a reallocated buffer would go silently stale)."""
    captures = 0

    def __init__(self, model, cache, warmup_steps: int = 2):
        StandInGraph.captures += 1
        self.model, self.cache, self.addresses = model, cache, self._addresses(cache)
        saved = _snapshot(cache)
        for _ in range(warmup_steps):
            model(torch.zeros(cache.num_seqs, 1, dtype=torch.long), cache=cache)
        _restore(cache, saved)

    @staticmethod
    def _addresses(cache) -> list[int]:
        return [t.data_ptr() for s in cache.layers
                for t in ((s.conv, s.recurrent) if isinstance(s, KDAState) else (s.buffer, s.lengths))]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self._addresses(self.cache) == self.addresses, "a cache tensor moved under a live graph"
        assert all(s.capacity > int(self.cache.lengths.max()) for s in self.cache.layers if isinstance(s, MLAState))
        return self.model(tokens.view(-1, 1), cache=self.cache)[:, 0]


def test_decode_graphs_capture_replay_and_recapture_exactly(model, prompts, monkeypatch):
    monkeypatch.setattr(runner_module, "CUDAGraphDecoder", StandInGraph)
    # small MLA growth steps, so the buffers fill (and the graph is dropped, then recaptured) mid-decode
    monkeypatch.setattr(cache_module, "MLA_CAPACITY_STEP", 32)
    monkeypatch.setattr(runner_module, "MLA_CAPACITY_STEP", 32)
    monkeypatch.setattr(runner_module, "GRAPH_MIN_ROOM", 4)
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8))
    engine.runner.cuda_graphs = True  # what a CUDA device with grouped_mm experts sets
    StandInGraph.captures = 0
    long = dataclasses.replace(GREEDY, max_tokens=40)
    stays = engine.add_request(prompts[2], long)  # 40 + 40 tokens: fills a 64-row buffer
    leaves = engine.add_request(prompts[0], dataclasses.replace(GREEDY, max_tokens=10))
    while engine.has_unfinished:
        engine.step()
    assert stays.output_token_ids == generate(model, [prompts[2]], 40)[0]
    assert leaves.output_token_ids == generate(model, [prompts[0]], 10)[0]
    # captured for the pair, again for the one left, and again after its buffers grew to 96 rows
    assert StandInGraph.captures == 3
    counts = engine.runner.step_counts
    assert counts["decode_graph_capture"] == 3 and counts["decode_graph_replay"] > 0
    # every step counted once: one packed prefill, stopped one token short by the prompt-end KDA
    # checkpoint (prefix caching), then a decode step for each of `stays`'s 40 tokens
    assert counts["packed"] == 1 and sum(counts[k] for k in STEP_KINDS if k.startswith("decode")) == 40, counts
    assert engine.runner._resident is None and engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_short_prompt_hits_on_second_send(model):
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64))
    prompt = [7, 8, 9, 10, 11]  # shorter than one page and one hash block
    first = engine.generate([prompt], GREEDY)
    assert engine.cache.stats.hits == 0
    assert engine.generate([prompt], GREEDY) == first
    assert engine.cache.stats.hits == 1 and engine.cache.stats.hit_tokens == len(prompt) - 1


def test_ten_turn_chat_reuses_previous_turns(model, tokenizer):
    chat = ChatFormat(tokenizer)
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64))
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly and kindly."}]
    rates = []
    for turn in range(10):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} plus {turn}?"})
        prompt = chat.render(messages)
        request = engine.add_request(prompt.token_ids, SamplingParams(max_tokens=8, temperature=0.0),
                                     boundaries=prompt.boundaries, eos_token_id=chat.close)
        while not request.status.finished:
            engine.step()
        rates.append(request.num_cached_tokens / request.num_prompt_tokens)
        reply = chat.parse(tokenizer.decode(request.output_token_ids))
        messages.append({"role": "assistant", "content": reply.content, "reasoning": reply.reasoning or None})
    hit_rate = sum(rates[1:]) / 9
    print(f"10-turn chat: prompt-token hit rate on turns 2-10 = {hit_rate:.1%} (per turn {[f'{r:.0%}' for r in rates]})")
    assert rates[0] == 0 and hit_rate >= 0.7
