"""Page pool, prefix cache and scheduler on CPU with exact expectations (ids, refcounts, order).

Layout used throughout: 4 tokens per MLA page, 8-token hash blocks (decoupled), and a KDA snapshot
that fits one page, so every number below can be followed by hand.
"""
from __future__ import annotations

import pytest
import torch

from k3.serve.block_pool import BlockPool, NoFreePagesError
from k3.serve.cache_manager import CacheManager
from k3.serve.page_layout import PageLayout
from k3.serve.request import Request, RequestStatus
from k3.serve.sampling import SampledToken, SamplingParams
from k3.serve.scheduler import QueueFullError, Scheduler


def layout(num_kda_layers: int = 1, block_size: int = 4) -> PageLayout:
    # page = 4 tokens x 1 MLA layer x 8 x 4 B = 128 B; snapshot = 2*2*4 + 6*1*4 = 40 B -> 1 page
    return PageLayout(block_size=block_size, num_mla_layers=1, cache_width=8, num_kda_layers=num_kda_layers,
                      kda_heads=1, kda_head_dim=2, conv_channels=6, conv_tail=1, dtype=torch.float32)


def request(rid: str, prompt: list[int], max_tokens: int = 1, boundaries=()) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), boundaries=boundaries)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, {r.request_id: [SampledToken(token)] for r in out.requests if r.sample})
    return out


PROMPT = list(range(100, 110))  # 10 tokens: one full hash block + 2


# ---------------------------------------------------------------------- pool
def test_pool_order_refcounts_and_errors():
    pool = BlockPool(11)
    assert pool.allocate(3) == [0, 1, 2]
    pool.mark_cached(1)
    pool.release([2, 1, 0])  # cached 1 -> tail; uncached 2 and 0 -> head (reused first)
    assert pool.free_order() == [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1]
    pool.pin([1])  # a hit takes it out of the queue
    assert pool.ref_cnt[1] == 1 and 1 not in pool.free_order()
    pool.pin([1])
    pool.release([1])
    assert pool.ref_cnt[1] == 1
    pool.release([1])
    assert pool.free_order()[-1] == 1
    evicted = []
    pool.on_evict = evicted.append
    assert pool.allocate(11) == [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1] and evicted == [1]
    with pytest.raises(NoFreePagesError):
        pool.allocate(1)
    pool.release([5])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([5])


# ---------------------------------------------------------------------- prefix cache
def test_kda_checkpoint_hit_with_copy_on_write_exact_pages():
    cm = CacheManager(layout(), 11, hash_block_size=8, retain_stopped=False)  # page orders without it
    s = Scheduler(cm, max_num_batched_tokens=64)
    r1 = request("r1", PROMPT)
    s.add_request(r1)
    out = run_step(s)  # miss: computes 9 tokens and stops at the prompt-end checkpoint (10 - 1)
    (sr,) = out.requests
    assert (sr.token_ids, sr.page_table, sr.state_pages, sr.sample) == (PROMPT[:9], [1, 2, 3], [[0]], False)
    assert out.plan.zero == [0] and out.plan.copy_before == [] and out.plan.copy_after == [(0, 4)]
    assert cm.pool.ref_cnt == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert cm.pool.free_order() == [5, 6, 7, 8, 9, 10, 4]  # the checkpoint is cached, at the tail
    run_step(s)  # the last prompt token: samples, finishes (max_tokens=1)
    assert r1.status == RequestStatus.FINISHED_LENGTH
    assert cm.pool.ref_cnt == [0] * 11
    # private state 0 first (reused first); the page table released tail first (evicted first)
    assert cm.pool.free_order() == [0, 5, 6, 7, 8, 9, 10, 4, 3, 2, 1]

    r2 = request("r2", PROMPT)
    s.add_request(r2)
    out = s.schedule()
    (sr,) = out.requests
    # hit at 9 = one full hash block + a partial one; full pages 1, 2 shared; partial page 3
    # copied into the new page 5; the checkpoint (page 4) copied into the private state (page 0)
    assert (sr.num_computed, sr.token_ids, sr.page_table, sr.state_pages) == (9, PROMPT[9:], [1, 2, 5], [[0]])
    assert out.plan.copy_before == [(3, 5), (4, 0)] and out.plan.zero == []
    assert cm.pool.ref_cnt == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # 3 and 4 pinned until copied
    s.update(out, {"r2": [SampledToken(7)]})
    assert cm.pool.ref_cnt == [0] * 11
    assert cm.pool.free_order() == [5, 0, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    st = cm.stats
    assert (st.queries, st.hits, st.hit_tokens, dict(st.miss_reasons)) == (2, 1, 9, {"no_prefix_match": 1})
    assert r2.num_cached_tokens == 9


def test_a_stopped_request_leaves_its_state_pages_as_a_checkpoint():
    cm = CacheManager(layout(), 11, hash_block_size=8)
    s = Scheduler(cm, max_num_batched_tokens=64)
    r1 = request("r1", PROMPT, max_tokens=3)
    s.add_request(r1)
    while s.has_unfinished:
        run_step(s, token=7)
    # 10 prompt tokens and 3 sampled: 12 computed, the last sampled one never run
    assert r1.status == RequestStatus.FINISHED_LENGTH and r1.output_token_ids == [7, 7, 7]
    entry = next(e for e in cm.prefix.entries.values() if e.length == 12)
    assert entry.kda_pages == [[0]]  # its private state page, adopted: no copy
    assert cm.pool.ref_cnt == [0] * 11 and cm.pool.is_cached(0)
    assert s.take_retained() == {"r1"} and not s.take_retained()  # for the runner to write back, once
    r2 = request("r2", PROMPT + [7, 7, 7, 5])
    s.add_request(r2)
    out = s.schedule()
    assert out.requests[0].num_computed == 12 and out.requests[0].token_ids == [7]  # to its prompt-end checkpoint
    assert (0, out.requests[0].state_pages[0][0]) in out.plan.copy_before
    s.update(out, {})
    out = s.schedule()
    # a request that fails leaves no state behind: its state may be what failed
    s.update(out, {"r2": [SampledToken(0, error="non-finite logits")]})
    assert r2.status == RequestStatus.FINISHED_ERROR and not s.take_retained()
    assert not any(e.length == 14 and e.kda_pages for e in cm.prefix.entries.values())


def test_prompt_shorter_than_a_page_hits_on_resend():
    cm = CacheManager(layout(block_size=16), 12, hash_block_size=64)
    s = Scheduler(cm)
    prompt = [3, 1, 4, 1, 5]
    s.add_request(request("a", prompt))
    run_step(s)
    run_step(s)
    s.add_request(request("b", prompt))
    out = run_step(s)
    assert out.requests[0].num_computed == 4 and out.requests[0].token_ids == [5]
    assert cm.stats.hits == 1 and cm.stats.hit_tokens == 4


def test_mla_match_without_checkpoint_reports_reason_and_saves_junction():
    cm = CacheManager(layout(), 30, hash_block_size=8)
    s = Scheduler(cm)
    s.add_request(request("a", list(range(20))))  # checkpoint at 19 only; MLA entries at 8 and 16
    while s.has_unfinished:
        run_step(s)
    b = request("b", list(range(12)) + [99, 98])  # shares 12 tokens: MLA match 8, no checkpoint there
    s.add_request(b)
    out = s.schedule()
    assert out.requests[0].num_computed == 0
    assert cm.stats.miss_reasons["no_kda_checkpoint"] == 1
    assert b.checkpoints == [8, 13]  # the junction (end of the MLA match) and the prompt end
    assert len(out.requests[0].token_ids) == 8  # the chunk stops at the junction to snapshot it
    s.update(out, {})
    c = request("c", list(range(8)) + [55] * 6)
    s.add_request(c)
    out = s.schedule()
    assert out.requests[0].num_computed == 8  # hits the junction checkpoint


def test_eviction_order_after_a_hit_and_sibling_invalidation():
    cm = CacheManager(layout(num_kda_layers=2), 11, hash_block_size=8, retain_stopped=False)
    s = Scheduler(cm, max_num_batched_tokens=64)
    s.add_request(request("a", PROMPT))
    run_step(s)
    run_step(s)
    # a held state [0, 1] and pages [2, 3, 4]; its checkpoint at 9 is one snapshot per KDA layer
    entry9 = next(e for e in cm.prefix.entries.values() if e.length == 9)
    assert entry9.kda_pages == [[5], [6]]
    assert cm.pool.free_order() == [1, 0, 7, 8, 9, 10, 5, 6, 4, 3, 2]
    s.add_request(request("b", PROMPT))
    out = run_step(s)
    # the hit pins 2, 3, 4, 5, 6 first, then allocates state [1, 0] and the copy-on-write page 7
    assert out.plan.copy_before == [(4, 7), (5, 1), (6, 0)]
    assert out.requests[0].page_table == [2, 3, 7]
    # after the hit its pages are the most recently used: the checkpoint 5, 6 and the partial
    # page 4 (released after the copy), then b's pages tail first; b's private pages at the head
    assert cm.pool.free_order() == [7, 0, 1, 8, 9, 10, 5, 6, 4, 3, 2]
    s.add_request(request("c", list(range(200, 210))))
    out = s.schedule()
    # c takes 7, 0 (state), 1, 8, 9 (pages) and for its checkpoint 10 then the LRU cached page 5:
    # evicting layer 0's snapshot invalidates the checkpoint, so its sibling 6 becomes a plain
    # free page at the head, while the MLA pages 4, 3, 2 stay cached
    assert out.plan.copy_after == [(7, 10), (0, 5)]
    assert cm.pool.num_evictions == 1 and cm.stats.checkpoints_invalidated == 1
    assert entry9.kda_pages is None and not cm.pool.is_cached(6)
    assert cm.pool.free_order() == [6, 4, 3, 2]
    assert sorted(p for p in range(11) if cm.pool.is_cached(p)) == [2, 3, 4]
    s.update(out, {})
    s.add_request(request("d", PROMPT))
    s.schedule()
    assert cm.stats.miss_reasons["no_kda_checkpoint"] == 1  # MLA still matches, the checkpoint is gone


def test_preemption_by_recompute():
    cm = CacheManager(layout(), 7, hash_block_size=8, enable_prefix_caching=False)
    s = Scheduler(cm, max_num_batched_tokens=64)
    a, b = request("a", [1, 2, 3], max_tokens=10), request("b", [4, 5, 6], max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    trace = []
    step = 0
    while s.has_unfinished:
        out = run_step(s, token=step)
        trace.append(([(r.request_id, r.num_computed, len(r.token_ids), r.page_table) for r in out.requests],
                      out.preempted, cm.pool.num_free))
        step += 1
    # both fit until a needs its third page at step 7: b, admitted last, is preempted (3 pages
    # back), waits while a finishes, then recomputes prompt + its 6 outputs in one chunk
    assert trace[5] == ([("a", 7, 1, [1, 4]), ("b", 7, 1, [3, 5])], [], 1)
    assert trace[6] == ([("a", 8, 1, [1, 4, 6])], ["b"], 3)
    assert trace[9] == ([("a", 11, 1, [1, 4, 6])], [], 7)
    assert trace[10] == ([("b", 0, 9, [4, 6, 0])], [], 3)
    assert a.output_token_ids == list(range(10))
    assert b.output_token_ids == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13]  # outputs kept across preemption
    assert b.num_preemptions == 1 and cm.pool.ref_cnt == [0] * 7


def test_queue_bound_and_length_errors():
    cm = CacheManager(layout(), 11, hash_block_size=8)
    s = Scheduler(cm, max_waiting=1)
    s.add_request(request("a", [1, 2]))
    with pytest.raises(QueueFullError):
        s.add_request(request("b", [1, 2]))
    with pytest.raises(ValueError, match="exceeds the model length"):
        s.add_request(Request("c", [1] * 30, SamplingParams(max_tokens=20)))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(request("a", [1, 2]))
