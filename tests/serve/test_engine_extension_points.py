"""The engine's extension points for in-process users (RL rollouts), with a small model at random init:
- `SamplingParams.logprobs_mode`: "raw" (the default) scores the model's T = 1 distribution,
  "processed" log softmax(z / T), the one sampled from before top-k / top-p (a greedy request:
  raw), on the plain and the speculative path, against the model's own logits;
- `SamplingParams.generator_state` in (it replaces the seed) and out (the finished output's
  `generator_state`): a stream stopped after some tokens and resumed from its state is the
  uninterrupted one, token for token (batch-invariant arithmetic);
- `LLMEngine.abort` returns the request's tokens and generator state between steps (None for an
  unknown request and during a step, whose finished output then carries the final state);
- `LLMEngine(..., sampler=...)`: a Sampler instance or a factory called with the config's seed."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from k3.model.draft import EagleDraft
from k3.model.transformer import K3ForCausalLM
from k3.serve.engine import AbortedRequest, EngineConfig, LLMEngine, RequestOutput
from k3.serve.sampling import Sampler, SamplingParams
from tests.helpers.models import randomized, small_config
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)

T = 0.7
SAMPLE = SamplingParams(max_tokens=8, temperature=T, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomized(K3ForCausalLM(small_config()))


@pytest.fixture(scope="module")
def prompt(model):
    return torch.randint(6, model.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1)).tolist()


def engine_for(model, **config) -> LLMEngine:
    return LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, cuda_graphs=False, **config))


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    rid = engine.add_request(prompt, params).request_id
    outputs = []
    while engine.has_unfinished:
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


def tokens_of(outputs: list[RequestOutput]):
    return [t for o in outputs for t in o.new_tokens]


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double()


def check_logprobs(model, prompt, sampled, temperature: float, top: int) -> None:
    ids = prompt + [t.token_id for t in sampled]
    logits = reference_logits(model, ids)[len(prompt) - 1:len(ids) - 1]
    expected = torch.log_softmax(logits / temperature, dim=-1)
    for row, t in zip(expected, sampled):
        assert t.logprob == pytest.approx(float(row[t.token_id]), abs=1e-5)
        best = torch.topk(row, top)
        assert [i for i, _ in t.top_logprobs] == best.indices.tolist()
        assert [v for _, v in t.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-5)


def test_logprobs_mode_raw_and_processed(model, prompt):
    assert SamplingParams().logprobs_mode == "raw"
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="sampled")
    engine = engine_for(model)
    raw = tokens_of(run(engine, prompt, dataclasses.replace(SAMPLE, logprobs=3)))
    processed = tokens_of(run(engine, prompt, dataclasses.replace(SAMPLE, logprobs=3, logprobs_mode="processed")))
    # the mode changes what is reported, never what is sampled
    assert [t.token_id for t in raw] == [t.token_id for t in processed] and len(raw) == 8
    check_logprobs(model, prompt, raw, 1.0, 3)
    check_logprobs(model, prompt, processed, T, 3)
    assert any(abs(r.logprob - p.logprob) > 1e-3 for r, p in zip(raw, processed))
    # a greedy request divides by no temperature: "processed" reports its raw logprobs
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, logprobs_mode="processed")
    check_logprobs(model, prompt, tokens_of(run(engine, prompt, greedy)), 1.0, 2)
    # a batch mixing both modes: each row reports its own
    a = engine.add_request(prompt, dataclasses.replace(SAMPLE, logprobs=1, max_tokens=4))
    b = engine.add_request(prompt[:9], dataclasses.replace(SAMPLE, logprobs=1, max_tokens=4, logprobs_mode="processed"))
    got = {a.request_id: [], b.request_id: []}
    while engine.has_unfinished:
        for o in engine.step():
            got[o.request_id] += o.new_tokens
    check_logprobs(model, prompt, got[a.request_id], 1.0, 1)
    check_logprobs(model, prompt[:9], got[b.request_id], T, 1)


def test_processed_logprobs_with_speculative_decoding(model, prompt):
    torch.manual_seed(2)
    draft = EagleDraft(model.config).eval()
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, cuda_graphs=False,
                                           num_speculative_tokens=2), draft=draft)
    sampled = tokens_of(run(engine, prompt, dataclasses.replace(SAMPLE, max_tokens=6, logprobs=2,
                                                                logprobs_mode="processed")))
    assert len(sampled) == 6 and engine.runner.spec_counts["drafted"] > 0  # tokens went through verification
    check_logprobs(model, prompt, sampled, T, 2)


def test_generator_state_in_and_out(model, prompt):
    engine = engine_for(model, batch_invariant=True)  # every token's logits the same whatever the chunking
    whole = run(engine, prompt, SAMPLE)
    full = [t.token_id for t in tokens_of(whole)]
    assert len(full) == 8 and whole[-1].finished and not any(o.generator_state is not None for o in whole[:-1])
    end = whole[-1].generator_state
    assert end is not None and end.dtype == torch.uint8 and end.device.type == "cpu"

    # stop after 3 tokens, resume from the finished output's state: the uninterrupted stream
    first = run(engine, prompt, dataclasses.replace(SAMPLE, max_tokens=3))
    state = first[-1].generator_state
    assert [t.token_id for t in tokens_of(first)] == full[:3]
    rest = run(engine, prompt + full[:3], dataclasses.replace(SAMPLE, max_tokens=5, seed=None, generator_state=state))
    assert [t.token_id for t in tokens_of(rest)] == full[3:]
    assert torch.equal(rest[-1].generator_state, end)  # the same stream ends in the same state
    # the state replaces the seed; the seed alone starts the stream again
    again = run(engine, prompt + full[:3], dataclasses.replace(SAMPLE, max_tokens=5, seed=99, generator_state=state))
    assert [t.token_id for t in tokens_of(again)] == full[3:]
    reseeded = run(engine, prompt + full[:3], dataclasses.replace(SAMPLE, max_tokens=5))
    assert [t.token_id for t in tokens_of(reseeded)] != full[3:]
    # a state is copied in, not kept: the caller's tensor stays as it was
    assert torch.equal(state, first[-1].generator_state)

    # no generator of its own: no state; a state that is none is refused
    assert run(engine, prompt, dataclasses.replace(SAMPLE, max_tokens=2, seed=None))[-1].generator_state is None
    with pytest.raises(ValueError, match="generator_state"):
        SamplingParams(generator_state=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="generator_state"):
        SamplingParams(generator_state=state.float())


def test_abort_returns_the_request_state(model, prompt):
    engine = engine_for(model, batch_invariant=True)
    full = [t.token_id for t in tokens_of(run(engine, prompt, SAMPLE))]
    request = engine.add_request(prompt, SAMPLE)
    waiting = engine.abort(engine.add_request(prompt[:5], SAMPLE).request_id)  # before its first step
    assert waiting.output_token_ids == [] and torch.equal(
        waiting.generator_state, torch.Generator().manual_seed(SAMPLE.seed).get_state())
    while len(request.output_token_ids) < 4:
        engine.step()
    aborted = engine.abort(request.request_id)
    assert isinstance(aborted, AbortedRequest) and aborted.request_id == request.request_id
    assert aborted.prompt_token_ids == prompt and aborted.output_token_ids == full[:4]
    outputs = engine.step()
    final = next(o for o in outputs if o.request_id == request.request_id)
    assert final.finished and final.finish_reason == "abort" and not final.new_tokens
    assert torch.equal(final.generator_state, aborted.generator_state)
    assert engine.abort(request.request_id) is None and engine.abort("nobody") is None
    resumed = run(engine, prompt + full[:4], dataclasses.replace(SAMPLE, max_tokens=4,
                                                                 generator_state=aborted.generator_state))
    assert [t.token_id for t in tokens_of(resumed)] == full[4:]

    # an abort during a step (another thread's, stood in for by a hook in the forward) returns
    # None: the step in flight still samples a token; the finished output carries the final state
    request = engine.add_request(prompt, SAMPLE)
    engine.step()
    execute, seen = engine.runner.execute, []

    def aborting(*args):
        seen.append(engine.abort(request.request_id))
        engine.runner.execute = execute
        return execute(*args)
    engine.runner.execute = aborting
    engine.step()
    assert seen == [None] and request.output_token_ids == full[:2]
    final = next(o for o in engine.step() if o.request_id == request.request_id)
    assert final.finish_reason == "abort" and final.num_output_tokens == 2
    resumed = run(engine, prompt + full[:2], dataclasses.replace(SAMPLE, max_tokens=3,
                                                                 generator_state=final.generator_state))
    assert [t.token_id for t in tokens_of(resumed)] == full[2:5]


class CountingSampler(Sampler):
    """A sampler subclass through the public API only: counts the rows it samples."""

    def __init__(self, seed=None):
        super().__init__(seed)
        self.seed, self.rows = seed, 0

    def sample(self, logits, request_ids, params):
        self.rows += len(request_ids)
        return super().sample(logits, request_ids, params)


def test_injected_sampler(model, prompt):
    default = engine_for(model)
    expected = [t.token_id for t in tokens_of(run(default, prompt, SAMPLE))]
    assert type(default.sampler) is Sampler

    mine = CountingSampler()
    engine = LLMEngine(model, EngineConfig(cuda_graphs=False), sampler=mine)
    assert engine.sampler is mine
    assert [t.token_id for t in tokens_of(run(engine, prompt, SAMPLE))] == expected
    assert mine.rows == 8

    engine = LLMEngine(model, EngineConfig(cuda_graphs=False, seed=5), sampler=CountingSampler)  # a factory
    assert isinstance(engine.sampler, CountingSampler) and engine.sampler.seed == 5
    run(engine, prompt, dataclasses.replace(SAMPLE, max_tokens=2))
    assert engine.sampler.rows == 2

    with pytest.raises(TypeError, match="Sampler"):
        LLMEngine(model, EngineConfig(cuda_graphs=False), sampler=object())
    with pytest.raises(TypeError, match="Sampler"):
        LLMEngine(model, EngineConfig(cuda_graphs=False), sampler=lambda seed: object())
