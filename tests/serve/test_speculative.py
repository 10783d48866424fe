"""Speculative decoding in the engine (DESIGN §11): with the real k3-tiny model at random init,
greedy outputs with speculation equal those without, token for token, for random batches, prompt
lengths, k in 1..6, with and without prefix-cache hits and with preemption forced; drafts come
from an oracle that proposes the right continuation corrupted at random, so every accepted length
0..k occurs (the real draft at random init accepts almost nothing); the random cases run under
`-m slow`, fixed ones by default. The verification rule keeps the target's distribution
(chi-square over 20k draws, temperature and top-p); the pool budget accounts for the draft states
and the replay inputs; bad settings are refused."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from k3.config import load_config
from k3.generation.generate import generate
from k3.model.draft import EagleDraft
from k3.model.transformer import K3ForCausalLM
from k3.sampling import sampling_probs
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.speculative_sampling import verify
from k3.serve.speculator import Proposal
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)

VOCAB = 320
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=VOCAB)).eval()


@pytest.fixture(scope="module")
def draft(model):
    torch.manual_seed(1)
    return EagleDraft(model.config).eval()


def oracle(engine: LLMEngine, reference: dict[tuple, list[int]], seed: int, noise: float = 0.35):
    """A stand-in for the draft's proposals: the reference continuation of the request's known
    tokens, each token replaced by a random one with probability `noise`."""
    rng = random.Random(seed)

    def propose(rids, last_tokens, counts, params, generators):
        out = []
        for rid, n in zip(rids, counts):
            request = engine.scheduler.requests[rid]
            full = list(request.prompt_token_ids) + reference[tuple(request.prompt_token_ids)]
            known = request.num_tokens
            tokens = (full[known:known + n] + [rng.randrange(VOCAB) for _ in range(n)])[:n]
            out.append(Proposal([rng.randrange(VOCAB) if rng.random() < noise else t for t in tokens], None))
        return out
    return propose


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def small_engine(model, draft, k, *, prefix_caching, states, budget, batch_invariant=False):
    """A pool with the private states of `states` sequences and latent pages for one longest
    sequence and a few more: running sequences soon outgrow it, forcing preemptions (admission "fixed":
    the auto rule would keep them from outgrowing it)."""
    cfg = EngineConfig(block_size=4, hash_block_size=8, max_num_seqs=4, max_num_batched_tokens=budget,
                       enable_prefix_caching=prefix_caching, num_speculative_tokens=k, batch_invariant=batch_invariant,
                       admission="fixed")
    probe = LLMEngine(model, cfg, draft=draft)
    layout = probe.layout
    pages = max(states, 2) * layout.pages_per_state + layout.mla_pages_for(40 + MAX_TOKENS) + states
    cfg.cache_bytes = probe.speculation_bytes + pages * layout.page_bytes
    return LLMEngine(model, cfg, draft=draft)


def plain_engine(model, *, prefix_caching, budget):
    return LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_seqs=4, max_num_batched_tokens=budget,
                                         enable_prefix_caching=prefix_caching, batch_invariant=True))


# Both engines compute with batch-invariant arithmetic (k3.ops.batch_invariant): without it the
# verify forward and a plain decode step land a few ulp apart, and a near-tied MoE route can turn
# that into another token (docs/LOG.md, "Speculative decoding"); the fixed cases are such cases.
@pytest.mark.parametrize("lengths, k, prefix_caching, states, budget, seed", [
    ([1, 1], 1, False, 2, 8, 8), ([1, 1], 6, True, 2, 8, 8)])
def test_greedy_with_speculation_equals_without_fixed_cases(model, draft, lengths, k, prefix_caching, states,
                                                            budget, seed):
    """The property test's former explicit examples, in the default run (the random ones run under
    `-m slow`); preemption and every accepted length: test_preemption_and_every_accepted_length_occur."""
    _check_greedy_with_speculation(model, draft, lengths, k, prefix_caching, states, budget, seed)


@pytest.mark.slow  # each example serves three engines in batch-invariant mode: ~45 s on 2 cores
@settings(max_examples=6, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5), k=st.integers(1, 6),
       prefix_caching=st.booleans(), states=st.integers(2, 5), budget=st.integers(8, 64), seed=st.integers(0, 99))
def test_greedy_with_speculation_equals_without(model, draft, lengths, k, prefix_caching, states, budget, seed):
    _check_greedy_with_speculation(model, draft, lengths, k, prefix_caching, states, budget, seed)


def _check_greedy_with_speculation(model, draft, lengths, k, prefix_caching, states, budget, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(6, VOCAB, (40,), generator=g).tolist()
    # every other prompt shares a prefix with the first: prefix-cache hits on the second pass
    prompts = [(base[:n] if i % 2 else torch.randint(6, VOCAB, (n,), generator=g).tolist()) for i, n in enumerate(lengths)]
    expected = run(plain_engine(model, prefix_caching=prefix_caching, budget=budget), prompts)
    reference = {tuple(p): e for p, e in zip(prompts, expected)}
    engine = small_engine(model, draft, k, prefix_caching=prefix_caching, states=states, budget=budget,
                          batch_invariant=True)
    engine.runner.speculator.propose = oracle(engine, reference, seed)
    assert run(engine, prompts) == expected
    assert run(engine, prompts) == expected  # again: now with hits where caching is on
    counts = engine.runner.spec_counts
    assert counts["verified"] > 0 and 0 < counts["accepted"] < counts["drafted"]
    pool = engine.cache.pool
    assert not engine.cache.requests and all(c == 0 for c in pool.ref_cnt)


def test_preemption_and_every_accepted_length_occur(model, draft):
    """The property test's regime does what it claims: preemptions happen and the accepted
    lengths 0..k all occur."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in (30, 12, 25, 7, 19, 33)]
    expected = generate(model, prompts, 2 * MAX_TOKENS)
    engine = small_engine(model, draft, 4, prefix_caching=True, states=2, budget=32)
    engine.runner.speculator.propose = oracle(engine, {tuple(p): e for p, e in zip(prompts, expected)}, 0, 0.15)
    lengths = []
    verify_one = engine.runner._verify

    def recording(rid, logits, proposal, p):
        out = verify_one(rid, logits, proposal, p)
        lengths.append(len(out) - 1)
        return out
    engine.runner._verify = recording
    assert run(engine, prompts, 2 * MAX_TOKENS) == expected
    assert engine.scheduler.num_preemptions > 0
    assert set(lengths) == set(range(5))


def test_real_draft_end_to_end(model, draft):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 9)]
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_seqs=4, num_speculative_tokens=3), draft=draft)
    assert run(engine, prompts) == generate(model, prompts, MAX_TOKENS)
    assert engine.runner.spec_counts["drafted"] > 0


def test_multi_turn_reuses_checkpoints_and_logprobs_and_stops_match(model, draft):
    """A second turn (the first turn's prompt, its reply and new text, with the turn boundary
    marked) hits the prefix cache at the boundary checkpoint and still decodes exactly; logprobs of
    speculated tokens equal the plain engine's; a stop token inside a run of accepted drafts ends
    the output right there."""
    g = torch.Generator().manual_seed(7)
    first = torch.randint(6, VOCAB, (21,), generator=g).tolist()
    reply = generate(model, [first], MAX_TOKENS)[0]
    second = first + reply + torch.randint(6, VOCAB, (9,), generator=g).tolist()
    expected = generate(model, [first, second], MAX_TOKENS)
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_seqs=4, num_speculative_tokens=4),
                       draft=draft)
    engine.runner.speculator.propose = oracle(engine, {tuple(first): expected[0], tuple(second): expected[1]}, 3, 0.2)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    r1 = engine.add_request(first, greedy)
    while engine.has_unfinished:
        engine.step()
    r2 = engine.add_request(second, greedy, boundaries=(len(first) + len(reply),))
    outputs = []
    while engine.has_unfinished:
        outputs += [t for o in engine.step() for t in o.new_tokens]
    assert r1.output_token_ids == expected[0] and r2.output_token_ids == expected[1]
    assert r2.num_cached_tokens == len(first) + len(reply) - 1  # the state where the first turn stopped
    plain = LLMEngine(model, EngineConfig(block_size=4))
    plain.add_request(second, greedy)
    reference = []
    while plain.has_unfinished:
        reference += [t for o in plain.step() for t in o.new_tokens]
    for got, ref in zip(outputs, reference):
        assert got.token_id == ref.token_id and abs(got.logprob - ref.logprob) < 1e-4
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in ref.top_logprobs]
    stop = expected[1][5]
    engine.add_request(second, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                              stop_token_ids=[stop]), request_id="stopping")
    stopped = []
    while engine.has_unfinished:
        stopped += [t.token_id for o in engine.step() for t in o.new_tokens]
    assert stopped == expected[1][:expected[1].index(stop) + 1]


def test_sampling_after_a_prefix_hit_starts_without_drafts(model, draft):
    """A resent prompt hits the cache and computes only its last token: the draft has nothing to
    start from yet, so that step verifies no drafts and samples plainly (it once failed there)."""
    prompt = list(range(10, 40))
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, num_speculative_tokens=3), draft=draft)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1, ignore_eos=True)
    for _ in range(2):
        request = engine.add_request(prompt, params)
        while engine.has_unfinished:
            engine.step()
        assert request.error is None and len(request.output_token_ids) == MAX_TOKENS
    assert request.num_cached_tokens > 0


def _chi_square_p(samples: list[int], probs: torch.Tensor) -> float:
    support = probs > 0
    assert all(support[s] for s in samples), "a token outside the target's support was emitted"
    observed = torch.bincount(torch.tensor(samples), minlength=probs.numel())[support].double()
    expected = probs[support].double() * len(samples)
    return chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue


@pytest.mark.parametrize("settings_", [  # the default run checks one; every filter under -m slow (~3 s each)
    {"temperature": 0.7, "top_p": 0.8}, pytest.param({"temperature": 1.0}, marks=pytest.mark.slow),
    pytest.param({"temperature": 1.3, "top_k": 5}, marks=pytest.mark.slow)])
def test_verification_keeps_the_target_distribution(settings_):
    """The first emitted token is distributed as the target's p_0; given it equals the first draft
    and a second token follows, that one as p_1 (the target's law after the draft), over 20k
    verifications of a 2-token draft from a deliberately different draft distribution."""
    torch.manual_seed(0)
    V, n = 12, 20000
    params = SamplingParams(max_tokens=4, **settings_)
    target = torch.randn(3, V) * 2
    draft_logits = torch.randn(2, V) * 2
    q = sampling_probs(draft_logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    p = sampling_probs(target, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    # Fixed draws, so the test is deterministic: a correct rule still fails a p > 0.01 check for 1%
    # of seeds, and there are six checks here (seed 1 fails one at p = 0.003; at 60k draws every
    # frequency is within 1.3 sigma of the target's).
    g = torch.Generator().manual_seed(3)
    firsts, seconds = [], []
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        out = verify(target, drafts, q, params, g)
        firsts.append(out[0])
        if out[0] == drafts[0] and len(out) > 1:
            # p_1 is the target's law given the first token is drafts[0]; here every draft[0] shares it
            seconds.append(out[1])
    assert _chi_square_p(firsts, p[0]) > 0.01
    assert len(seconds) > 1000 and _chi_square_p(seconds, p[1]) > 0.01


def test_pool_accounts_for_draft_states_and_replay_inputs(model, draft):
    plain = LLMEngine(model, EngineConfig(block_size=4, max_num_seqs=8))
    spec = LLMEngine(model, EngineConfig(block_size=4, max_num_seqs=8, num_speculative_tokens=4), draft=draft)
    layout = spec.layout
    per_seq = spec.runner.speculator.state_bytes() + 5 * layout.replay_bytes_per_token
    assert spec.speculation_bytes == 8 * per_seq
    # what a per-position state copy would cost instead: k snapshots of every KDA layer per sequence
    assert 5 * layout.replay_bytes_per_token < 4 * layout.num_kda_layers * layout.snapshot_bytes
    assert plain.runner.pool.shape[0] - spec.runner.pool.shape[0] == pytest.approx(
        spec.speculation_bytes / layout.page_bytes, abs=1)


@pytest.mark.parametrize("k, draft_given, message", [
    (0, True, "num_speculative_tokens is 0"), (3, False, "needs both a draft"), (17, True, "must be in [1, 16]")])
def test_bad_settings_are_refused(model, draft, k, draft_given, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LLMEngine(model, EngineConfig(num_speculative_tokens=k), draft=draft if draft_given else None)
    with pytest.raises(ValueError, match="exclude each other"):
        LLMEngine(model, EngineConfig(batch_invariant=True, compile="inductor"))


@pytest.mark.slow
@pytest.mark.parametrize("settings_", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}])
def test_engine_sampling_with_speculation_keeps_the_target_distribution(settings_):
    """Through the engine, on a 24-token vocabulary, 20k requests of 3 new tokens with k = 2 and the
    random-init draft: the first token comes from the prefill step, the second and third from a
    speculative step (a kept draft, a residual draw or the bonus token); each position's empirical
    distribution matches the model's exact marginal there (summed over the earlier tokens from its
    own distributions), chi-square p > 0.01."""
    torch.manual_seed(0)
    V, n = 24, 20000
    model = K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=V)).eval()
    draft = EagleDraft(model.config).eval()
    prompt = [5, 9, 13]
    params = SamplingParams(max_tokens=3, ignore_eos=True, **settings_)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=256, max_waiting=1000, max_num_batched_tokens=2048,
                                           num_speculative_tokens=2, cache_bytes=512 << 20, seed=0,
                                           enable_prefix_caching=False), draft=draft)
    outs = []
    for _ in range(n // 1000):
        outs += engine.generate([prompt] * 1000, params)
    counts = engine.runner.spec_counts
    assert counts["drafted"] > 0 and 0 < counts["accepted"] < counts["drafted"]
    law = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
    with torch.no_grad():
        p0 = sampling_probs(model(torch.tensor([prompt]))[0, -1:], **law)[0]  # [V]
        firsts = torch.tensor([prompt + [f] for f in range(V)])
        p1 = sampling_probs(model(firsts)[:, -1], **law)  # [V(first), V]
        pairs = torch.tensor([prompt + [f, t] for f in range(V) for t in range(V)])
        p2 = sampling_probs(model(pairs)[:, -1], **law).view(V, V, V)  # [first, second, V]
    joint1 = p0[:, None] * p1  # P(first, second)
    marginals = [p0, joint1.sum(0), (joint1[:, :, None] * p2).sum((0, 1))]
    for i, marginal in enumerate(marginals):
        assert _chi_square_p([o[i] for o in outs], marginal) > 0.01, f"token {i}"
