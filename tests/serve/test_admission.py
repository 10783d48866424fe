"""Auto-throttled admission: the rule's arithmetic and adaptation, and on a burst of long requests
over a pool that fits a quarter of them, no preemption thrash and as few steps as the best fixed
`max_num_seqs` (scheduler-level, exact counts); the engine's tokens unchanged under it."""
from __future__ import annotations

import pytest

from k3.serve.admission import AdmissionController
from k3.serve.cache_manager import CacheManager
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Scheduler
from tests.serve.fakes import FakeModel, one_torch_thread, reference_generate  # noqa: F401 (fixture)
from tests.serve.test_cache import layout, request, run_step


def test_rule_projection_and_adaptation():
    a = AdmissionController(100, target_usage=0.9, output_ratio=0.5, min_output_ratio=0.2, ratio_decay=0.1)
    assert a.projected_tokens(10, 20, 1000) == 20 and a.projected_tokens(10, 20, 15) == 15
    assert a.admits(used=50, growth=30, need=10, num_running=3)  # 90 <= 90
    assert not a.admits(used=50, growth=30, need=11, num_running=3) and a.deferred == 1
    assert a.admits(used=99, growth=99, need=99, num_running=0)  # nothing runs: progress
    for _ in range(5):
        a.step(preempted=False)
    assert a.ratio == pytest.approx(0.2)  # decays to the floor
    a.step(preempted=True)
    assert a.ratio == 1.0  # a preemption: reserve whole outputs


def test_bad_knobs_are_one_line_errors():
    for kwargs in ({"target_usage": 0}, {"output_ratio": 1.5}, {"min_output_ratio": 0.9}, {"ratio_decay": -1}):
        with pytest.raises(ValueError, match="admission"):
            AdmissionController(10, **kwargs)
    with pytest.raises(ValueError, match="admission"):
        LLMEngine(FakeModel(), EngineConfig(admission="sometimes"))


def burst(admission: AdmissionController | None, max_num_seqs: int = 64) -> tuple[int, int]:
    """16 requests of 12 prompt + 28 output tokens (11 pages each at the end) over 47 pages: steps
    to finish them all, and preemptions."""
    cm = CacheManager(layout(), 47, hash_block_size=8, enable_prefix_caching=False)
    s = Scheduler(cm, max_num_batched_tokens=64, max_num_seqs=max_num_seqs, admission=admission)
    requests = [request(f"r{n}", [n + 1] * 12, max_tokens=28) for n in range(16)]
    for r in requests:
        s.add_request(r)
    steps = 0
    while s.has_unfinished:
        run_step(s)
        steps += 1
    assert all(len(r.output_token_ids) == 28 for r in requests) and cm.pool.ref_cnt == [0] * 47
    return steps, s.num_preemptions


def test_burst_of_long_requests_does_not_thrash():
    """The fixed rule at max_num_seqs 64 preempts again and again; the auto rule hardly ever, and
    takes no more steps than the best fixed setting that never preempts (a step here counts no
    recompute, which favours the preempting settings)."""
    _, fixed_preemptions = burst(None)
    sweep = [burst(None, n) for n in (2, 3, 4, 5, 6)]
    auto_steps, auto_preemptions = burst(AdmissionController(47))
    assert fixed_preemptions >= 10 and auto_preemptions <= 0.1 * fixed_preemptions
    assert auto_steps <= 1.1 * min(steps for steps, preemptions in sweep if preemptions == 0)


def test_engine_tokens_unchanged_under_auto_admission():
    model = FakeModel()
    page = LLMEngine(model, EngineConfig(block_size=4)).layout.page_bytes
    prompts = [[n + 1] * 10 + [n] for n in range(5)]
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, cache_bytes=24 * page))
    got = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert got == [reference_generate(p, 10) for p in prompts]
    assert engine.scheduler.admission.admitted >= 5 and engine.scheduler.admission.deferred > 0
    assert engine.scheduler.num_preemptions == 0
