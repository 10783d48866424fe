"""Property test: random request mixes with shared prefixes, cancellations, evictions and
preemptions never leak a page, always bring every refcount back to zero, never mutate a cached
snapshot or cached latent row, and always produce the reference tokens (FakeModel's next token is
a function of the whole prefix computed through the restored state)."""
from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from tests.serve.fakes import FakeModel, one_torch_thread, reference_generate  # noqa: F401 (fixture)

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24], [1, 2, 3, 4, 5, 6, 7, 8, 40]]

request_strategy = st.tuples(
    st.sampled_from(range(len(BASES))),  # shared prefix
    st.lists(st.integers(0, 60), max_size=10),  # private suffix
    st.integers(1, 6),  # max_tokens
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 12)),  # cancel at step
)


def _cached_bytes(engine: LLMEngine) -> dict:
    """Checksum of every cached snapshot page and every cached latent row range, by entry."""
    pool, layout = engine.runner.pool, engine.layout
    sums = {}
    for key, e in engine.cache.prefix.entries.items():
        if e.kda_pages is not None:
            data = pool[[p for s in e.kda_pages for p in s]].numpy().tobytes()
            sums[(key, "kda", tuple(map(tuple, e.kda_pages)))] = hashlib.sha1(data).hexdigest()
        start = (e.length - 1) // engine.cache.prefix.hash_block_size * engine.cache.prefix.hash_block_size
        rows = []
        for i, page in sorted(e.mla_pages.items()):
            lo, hi = max(start, i * layout.block_size), min(e.length, (i + 1) * layout.block_size)
            lat = engine.runner.latent_pages()[page]  # rows i * P .. (i + 1) * P
            rows.append(lat[lo - i * layout.block_size:hi - i * layout.block_size].numpy().tobytes())
        sums[(key, "mla", tuple(sorted(e.mla_pages.items())))] = hashlib.sha1(b"".join(rows)).hexdigest()
    return sums


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# found by this test: two prompts ending inside the same hash block at the same offset (different
# tokens, so different keys); evicting both must not lose count of the offset
@example(requests=[(0, [], 1, 0, None)] * 4 + [(0, [0] * 8, 1, 1, None), (1, [0, 0], 1, 0, None), (1, [1, 0], 1, 0, None)],
         num_pages=16, budget=3, prefix_caching=True)
@given(requests=st.lists(request_strategy, min_size=1, max_size=7), num_pages=st.integers(16, 40),
       budget=st.integers(3, 16), prefix_caching=st.booleans())
def test_random_mixes_leak_nothing_and_never_mutate_cached_pages(requests, num_pages, budget, prefix_caching):
    model = FakeModel()
    probe = LLMEngine(model, EngineConfig(block_size=4))
    cfg = EngineConfig(block_size=4, hash_block_size=8, cache_bytes=num_pages * probe.layout.page_bytes,
                       max_num_batched_tokens=budget, max_num_seqs=4, enable_prefix_caching=prefix_caching,
                       admission="fixed")  # preemptions wanted (the auto rule avoids them)
    engine = LLMEngine(model, cfg)
    pending = sorted(enumerate(requests), key=lambda x: x[1][3])
    tokens: dict[str, list[int]] = {}
    finished: dict[str, bool] = {}
    seen: dict = {}
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][1][3] <= step:
            i, (base, suffix, max_tokens, _, _) = pending.pop(0)
            rid = f"r{i}"
            engine.add_request(BASES[base] + suffix, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               request_id=rid)
            tokens[rid], finished[rid] = [], False
        for i, (_, _, _, _, cancel) in enumerate(requests):
            if cancel == step and f"r{i}" in tokens and not finished[f"r{i}"]:
                engine.abort(f"r{i}")
        for o in engine.step():
            tokens[o.request_id] += [t.token_id for t in o.new_tokens]
            finished[o.request_id] |= o.finished
        for key, digest in _cached_bytes(engine).items():
            assert seen.setdefault(key, digest) == digest, f"cached pages {key[1:]} changed after caching"
        step += 1
        assert step < 500, "the engine stopped making progress"
    pool = engine.cache.pool
    assert pool.ref_cnt == [0] * pool.num_pages and pool.num_free == pool.num_pages
    assert not engine.cache.requests and not engine.scheduler.requests
    for i, (base, suffix, max_tokens, _, cancel) in enumerate(requests):
        ref = reference_generate(BASES[base] + suffix, max_tokens)
        got = tokens[f"r{i}"]
        assert got == ref[:len(got)], f"r{i}: {got} != reference {ref}"
        if cancel is None:
            assert got == ref
