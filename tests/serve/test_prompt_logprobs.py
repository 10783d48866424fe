"""Prompt log-probabilities: the scheduler's score ranges, the prefix-cache bypass and a
preemption's recompute on exact ids; the engine's scores against `log_softmax` of the model's own
logits through chunked prefill, decode-slot steps and a preemption; and `/v1/completions` with
echo + logprobs (vLLM's legacy shape, max_tokens 0 or more) against the same reference, for prompts
shorter and longer than a cache block, with the prompt in the prefix cache and without."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from k3.model.transformer import K3ForCausalLM
from k3.serve.api.server import ServerThread, build_app
from k3.serve.cache_manager import CacheManager
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.serve.request import Request, RequestStatus
from k3.serve.sampling import SampledToken, SamplingParams
from k3.serve.scheduler import Scheduler
from k3.text.tokenizer import train_tokenizer
from tests.helpers import assert_rel_close
from tests.helpers.models import randomized, small_config
from tests.serve.fakes import PoisonModel, one_torch_thread  # noqa: F401 (autouse fixture)
from tests.serve.test_cache import layout

CORPUS = ["The quick brown fox jumps over the lazy dog.", "To be, or not to be, that is the question."] * 4


# ---------------------------------------------------------------------- scheduler (ids only)
def _scores(out) -> list[tuple[str, int, list[int], bool]]:
    return [(r.request_id, r.score_from, r.score_targets, r.sample) for r in out.requests]


def _step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, {r.request_id: [SampledToken(token)] for r in out.requests if r.sample},
             {r.request_id: [SampledToken(t, -1.0) for t in r.score_targets] for r in out.requests})
    return out


def test_scheduler_scores_each_prompt_position_once():
    cm = CacheManager(layout(), 40, hash_block_size=8)
    s = Scheduler(cm, max_num_batched_tokens=4)
    prompt = list(range(100, 110))
    warm = Request("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    s.add_request(warm)
    while s.has_unfinished:
        _step(s)
    # the prompt is cached now; a scoring request still computes it all, in chunks of 4 (and one
    # ending at the KDA checkpoint before the last prompt token, whose logits score no prompt token)
    scoring = Request("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    s.add_request(scoring)
    trace = []
    while s.has_unfinished:
        trace.append(_scores(_step(s)))
    assert trace == [[("score", 0, prompt[1:5], False)], [("score", 4, prompt[5:9], False)],
                     [("score", 8, prompt[9:10], False)], [("score", 9, [], False)]]
    assert scoring.num_cached_tokens == 0 and cm.stats.miss_reasons["prompt_logprobs"] == 1
    assert [e.token_id for e in scoring.prompt_logprobs] == prompt[1:]
    assert scoring.status == RequestStatus.FINISHED_LENGTH and scoring.output_token_ids == []
    # what it computed is cached for the others
    again = Request("again", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    s.add_request(again)
    _step(s)
    assert again.num_cached_tokens == len(prompt) - 1


def test_scheduler_recompute_after_preemption_scores_nothing_twice():
    cm = CacheManager(layout(), 7, hash_block_size=8, enable_prefix_caching=False)
    s = Scheduler(cm, max_num_batched_tokens=64)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0))
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=0))
    s.add_request(a)
    s.add_request(b)
    trace = []
    while s.has_unfinished:
        trace.append(_scores(_step(s)))
    assert trace[0] == [("a", 0, [], True), ("b", 0, [5, 6], True)]
    assert b.num_preemptions == 1  # recomputed from 0 (test_cache.py's trace), scoring nothing again
    assert all(not targets for step in trace[1:] for _, _, targets, _ in step)
    assert [e.token_id for e in b.prompt_logprobs] == [5, 6] and len(b.output_token_ids) == 10


# ---------------------------------------------------------------------- engine (tensors)
@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, 300)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return randomized(K3ForCausalLM(small_config(vocab_size=tokenizer.get_vocab_size())))


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's own logits, [T, V] in fp64."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)


def check_scores(model, ids: list[int], entries: list[SampledToken], top: int) -> None:
    ref = reference_logprobs(model, ids)
    assert [e.token_id for e in entries] == ids[1:]
    if len(ids) > 1:
        got = torch.tensor([e.logprob for e in entries], dtype=torch.float64)
        assert_rel_close(f"prompt logprobs T={len(ids)}", ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], got,
                         1e-5)
    for pos, e in enumerate(entries):
        best = ref[pos].topk(top)
        assert [i for i, _ in e.top_logprobs or ()] == best.indices.tolist()


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list]:
    """Each request's outputs, in order."""
    rids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
    outputs: dict[str, list] = {rid: [] for rid in rids}
    while engine.has_unfinished:
        for o in engine.step():
            outputs[o.request_id].append(o)
    return [outputs[rid] for rid in rids]


@pytest.mark.parametrize("budget", [7, 3], ids=["chunk7", "chunk3-decode-slots"])
def test_engine_scores_equal_log_softmax(model, budget):
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=budget,
                                           max_model_len=128))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, model.config.vocab_size, (n,), generator=g).tolist() for n in (2, 3, 21, 40)]
    # a decoding request first, so that 1-token scoring chunks share decode-slot steps with it
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] + [
        SamplingParams(max_tokens=m, temperature=0.0, logprobs=1, prompt_logprobs=2, ignore_eos=True)
        for m in (0, 1, 3)]
    outputs = run(engine, prompts, params)
    assert outputs[0][0].prompt_logprobs is None  # not asked
    for ids, outs, sp in zip(prompts[1:], outputs[1:], params[1:]):
        with_scores = [o for o in outs if o.prompt_logprobs is not None]
        assert len(with_scores) == 1 and with_scores[0] is outs[0]  # once, with the first output
        check_scores(model, ids, with_scores[0].prompt_logprobs, 2)
        assert outs[-1].finish_reason == "length" and sum(len(o.new_tokens) for o in outs) == sp.max_tokens
    if budget == 3:
        assert engine.runner.step_counts["decode_eager"] > 0


def test_engine_scores_survive_preemption(model):
    """72 pages of 4 tokens (a request's KDA state alone takes 30): the decoding request's growth
    preempts the scoring one, mid-prompt, again and again; each recompute scores only what is left."""
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=4,
                                           cache_bytes=72 * engine_page_bytes(model), max_model_len=64,
                                           admission="fixed"))  # preemption wanted
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, model.config.vocab_size, (n,), generator=g).tolist() for n in (2, 40)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, ignore_eos=True)]
    outputs = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    check_scores(model, prompts[1], outputs[1][0].prompt_logprobs, 1)


def engine_page_bytes(model) -> int:
    return LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, cache_bytes=1 << 20)).layout.page_bytes


def test_a_prompt_with_non_finite_scores_fails_alone():
    """NaN logits after the poison token: that request finishes with "error", its batch-mate scores."""
    engine = LLMEngine(PoisonModel(), EngineConfig(block_size=4, hash_block_size=8, max_model_len=64))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    good, bad = run(engine, [[5, 6, 7, 8], [5, PoisonModel().poison, 6, 7]], [params, params])
    assert bad[-1].finish_reason == "error" and "non-finite" in bad[-1].error
    assert good[-1].finish_reason == "length" and len(good[0].prompt_logprobs) == 3
    assert engine.cache.pool.num_used == 0


# ---------------------------------------------------------------------- the API
@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=16,
                                           max_model_len=256))
    with ServerThread(build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="tiny")) as s:
        yield s, engine


def complete(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("length", [3, 37], ids=["shorter-than-a-block", "longer"])
def test_echo_logprobs_equal_log_softmax_with_and_without_cache(server, model, tokenizer, length):
    s, _ = server
    ids = torch.randint(6, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    ref = reference_logprobs(model, ids)
    first = complete(s, prompt=ids, echo=True, logprobs=3, max_tokens=0)  # a cold cache
    complete(s, prompt=ids, max_tokens=1)  # the prompt is cached now: this one hits
    assert complete(s, prompt=ids, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    second = complete(s, prompt=ids, echo=True, logprobs=3, max_tokens=2)  # bypasses the cached prefix
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for resp in (first, second):
        choice = resp["choices"][0]
        lp = choice["logprobs"]
        n_out = resp["usage"]["completion_tokens"]
        assert len(lp["tokens"]) == len(ids) + n_out and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        got = torch.tensor(lp["token_logprobs"][1:len(ids)], dtype=torch.float64)
        assert_rel_close("echo logprobs", ref[torch.arange(length - 1), torch.tensor(ids[1:])], got, 1e-5)
        for pos, top in enumerate(lp["top_logprobs"][1:len(ids)]):
            assert max(top.values()) == pytest.approx(ref[pos].max().item(), abs=1e-5) and len(top) <= 3
        prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
        assert choice["text"].startswith(prompt_text)
        offsets = lp["text_offset"]
        assert offsets[:len(ids)] == sorted(offsets[:len(ids)]) and offsets[len(ids):] == sorted(offsets[len(ids):])
        assert not n_out or offsets[len(ids)] == len(prompt_text)  # the completion's tokens follow the echo
    assert first["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=False)
    assert first["choices"][0]["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 0


def test_echo_text_stream_and_refusals(server, tokenizer):
    s, _ = server
    prompt = "The quick brown fox"
    full = complete(s, prompt=prompt, echo=True, max_tokens=3, ignore_eos=True, logprobs=1)
    assert full["choices"][0]["text"].startswith(prompt)
    with httpx.stream("POST", s.url + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "echo": True, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True}, timeout=60) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    choices = [json.loads(c[6:])["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == full["choices"][0]["text"]
    streamed = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == full["choices"][0]["logprobs"]["token_logprobs"]
    for body in ({"prompt": prompt, "max_tokens": 0}, {"prompt": prompt, "echo": "yes"},
                 {"prompt": prompt, "echo": True, "max_tokens": -1}):
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
