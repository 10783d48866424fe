"""The prefix cache's host tier: write-back on eviction, the lookup over both tiers, prefetch a step
ahead, and outputs unchanged (FakeModel's exact tokens, and the real k3-tiny's greedy tokens with
and without the tier) on a multi-session chat whose prefixes outgrow the device pool."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.serve.api.metrics import Metrics
from k3.serve.cache_manager import CacheManager
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Scheduler
from tests.serve.fakes import FakeModel, one_torch_thread, reference_generate  # noqa: F401 (fixture)
from tests.serve.test_cache import PROMPT, layout, request, run_step


def test_evicted_prefix_is_written_back_and_prefetched_a_step_ahead():
    cm = CacheManager(layout(), 12, hash_block_size=8, host_pages=16)
    s = Scheduler(cm, max_num_batched_tokens=64)
    s.add_request(request("a", PROMPT))
    while s.has_unfinished:
        run_step(s)
    cached = dict(cm.prefix.entries)
    # other prompts take every page: each of a's entries is written back as its pages are reused
    write_back = []
    for n in range(2):
        s.add_request(request(f"x{n}", [50 + n] * 30))
        while s.has_unfinished:
            write_back += run_step(s).plan.write_back
    assert not set(cached) & set(cm.prefix.entries) and set(cached) <= set(cm.host.cache.entries)
    assert len(write_back) == cm.host.stats.write_back_pages > 0
    # a's prompt again: the lookup finds it on the host, prefetches it and waits one step
    s.add_request(request("a2", PROMPT))
    out = run_step(s)
    assert not any(r.request_id == "a2" for r in out.requests) and out.plan.prefetch
    assert all(cm.pool.ref_cnt[d] >= 1 for _, d in out.plan.prefetch)  # held for a2 until it runs
    out = run_step(s)  # now a device hit: only the last prompt token is computed
    (sr,) = out.requests
    assert (sr.request_id, sr.num_computed, sr.token_ids) == ("a2", 9, PROMPT[9:])
    assert cm.host.stats.hits == 1 and cm.host.stats.hit_tokens == 9
    while s.has_unfinished:
        run_step(s)
    assert cm.pool.ref_cnt == [0] * 12 and cm.host.pool.ref_cnt == [0] * 16


def test_host_tier_lru_keeps_only_what_fits():
    cm = CacheManager(layout(), 12, hash_block_size=8, host_pages=5)
    s = Scheduler(cm, max_num_batched_tokens=64)
    for n in range(6):
        s.add_request(request(f"r{n}", [10 * n + k for k in range(10)]))
        while s.has_unfinished:
            run_step(s)
    assert cm.host.pool.num_evictions > 0 and cm.host.pool.ref_cnt == [0] * 5
    host_pages = [p for e in cm.host.cache.entries.values() for p in e.mla_pages.values()]
    assert len(host_pages) <= 5


def chat(engine: LLMEngine, sessions: int, turns: int, user: int = 6) -> tuple[list[list[int]], int]:
    """Round-robin sessions, one turn each per round (all of a round at once): every turn's prompt is
    the session's history plus `user` new tokens. Returns each request's outputs and the prefix tokens
    recomputed (history tokens the cache did not serve)."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    history = [[] for _ in range(sessions)]
    outputs, recomputed = [], 0
    for _ in range(turns):
        ids = {}
        for s in range(sessions):
            prompt = history[s] + torch.randint(3, vocab, (user,), generator=g).tolist()
            ids[engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                   boundaries=(len(history[s]),) if history[s] else ()).request_id] = (s, prompt)
        got = {rid: [] for rid in ids}
        while engine.has_unfinished:
            for o in engine.step():
                got[o.request_id] += [t.token_id for t in o.new_tokens]
                if o.finished and history[ids[o.request_id][0]]:
                    recomputed += max(len(history[ids[o.request_id][0]]) - 1 - o.num_cached_tokens, 0)
        for rid, (s, prompt) in ids.items():
            history[s] = prompt + got[rid]
            outputs.append(got[rid])
    return outputs, recomputed


def fake_engine(host_pages: int) -> LLMEngine:
    page = LLMEngine(FakeModel(), EngineConfig(block_size=4)).layout.page_bytes
    return LLMEngine(FakeModel(), EngineConfig(block_size=4, hash_block_size=8, cache_bytes=22 * page,
                                               host_cache_bytes=host_pages * page, max_num_batched_tokens=16))


def test_multi_session_chat_exact_with_far_less_recompute():
    """4 sessions x 3 turns over a 22-page pool (a session's live prefix reaches 10 pages, MLA and a
    checkpoint: 1.8x the pool): the tier cuts the recomputed history by over 80%, every token is
    FakeModel's own."""
    without, with_tier = fake_engine(0), fake_engine(400)
    plain, recomputed_without = chat(without, 4, 3, user=5)
    tiered, recomputed_with = chat(with_tier, 4, 3, user=5)
    assert tiered == plain
    g, vocab, history = torch.Generator().manual_seed(0), without.model.config.vocab_size, [[] for _ in range(4)]
    for turn in range(3):  # the reference: FakeModel's next token through the whole history
        for s in range(4):
            prompt = history[s] + torch.randint(3, vocab, (5,), generator=g).tolist()
            history[s] = prompt + reference_generate(prompt, 4)
            assert tiered[turn * 4 + s] == history[s][-4:]
    assert recomputed_with <= 0.2 * recomputed_without and recomputed_without > 0
    host = with_tier.cache.host
    assert host.stats.hits > 0 and host.stats.write_back_pages > 0
    assert with_tier.runner.transfer.bytes["prefetch"] == host.stats.prefetch_pages * with_tier.layout.page_bytes
    assert with_tier.cache.pool.ref_cnt == [0] * with_tier.cache.pool.num_pages
    assert host.pool.ref_cnt == [0] * host.pool.num_pages
    text = generate_latest(Metrics(with_tier).registry)
    for name in (b'k3_prefix_cache_tier_hits_total{tier="host"}', b'k3_host_cache_bytes_total{direction="prefetch"}',
                 b"k3_host_cache_prefetch_seconds_total", b"k3_admissions_total"):
        assert name in text


def test_real_model_greedy_identical_with_and_without_the_tier():
    """k3-tiny cut to 4 layers (KDA and MLA twice each): the same chat with a device pool too small
    for its sessions, with and without a host tier: the same greedy tokens, and the tier was used."""
    torch.manual_seed(0)
    cfg = load_config("k3-tiny").replace(vocab_size=64, num_hidden_layers=4, kda_layers=[1, 3],
                                         full_attn_layers=[2, 4])
    model = K3ForCausalLM(cfg).eval()
    page = LLMEngine(model, EngineConfig(block_size=4)).layout.page_bytes
    state = LLMEngine(model, EngineConfig(block_size=4)).layout.pages_per_state

    def engine(host: int) -> LLMEngine:
        return LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, cache_bytes=(3 * state + 16) * page,
                                             host_cache_bytes=host * page, max_num_batched_tokens=32))

    with_tier = engine(40 * state)
    assert chat(with_tier, 3, 2, user=5)[0] == chat(engine(0), 3, 2, user=5)[0]
    assert with_tier.cache.host.stats.hits > 0


def test_negative_host_cache_is_refused():
    with pytest.raises(ValueError, match="host_cache_bytes"):
        LLMEngine(FakeModel(), EngineConfig(host_cache_bytes=-1))


def test_serve_flags_reach_the_engine_config():
    import argparse

    from k3.serve.cli import add_arguments, check_engine_settings, engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--run", "r", "--host-cache-gb", "0.5", "--admission", "fixed",
                         "--admission-output-ratio", "0.9"])
    cfg = engine_config(args)
    assert (cfg.host_cache_bytes, cfg.admission, cfg.admission_output_ratio) == (1 << 29, "fixed", 0.9)
    assert engine_config(p.parse_args(["--run", "r"])).admission == "auto"
    with pytest.raises(ValueError, match="--host-cache-gb must be >= 0"):
        check_engine_settings(p.parse_args(["--run", "r", "--host-cache-gb", "-1"]))
