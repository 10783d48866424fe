"""Rollouts through the serving engine (k3-tiny at random init): the recorded behaviour log-probs
equal the trainer's recomputed ones (fp32, within 1e-5; with QAT in batch-invariant arithmetic on
both sides); a group's followers reuse the leader's prompt from the prefix cache; partial rollout
with stop_fraction 1 is the synchronous rollout bit for bit, and split over iterations at 0.5 it
loses and duplicates nothing, records each token's policy version, and (same weights,
batch-invariant) gives back exactly the trajectories sampled without a pause."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.quant.qat import apply_qat
from k3.rl.objective import pack_trajectories, token_logprobs
from k3.rl.rollout import Prompt, Rollouts, trajectory_seed
from k3.serve.engine import EngineConfig
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)

T = 0.8  # a temperature other than 1: the log-probs must be of the distribution sampled from
STOPS = list(range(6, 40))  # about one token in nine stops a completion: long-tailed lengths
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=320)).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(40, 320, (n,), generator=g).tolist() for n in (20, 7, 33)]


def rollouts(model, max_tokens=MAX_TOKENS, **engine):
    return Rollouts(model, EngineConfig(cuda_graphs=False, **engine), temperature=T, max_tokens=max_tokens,
                    stop_token_ids=STOPS)


def record(trajectories):
    """Everything a trajectory's sampling produced, by uid."""
    return {t.uid: (t.prompt_ids, t.completion_ids, t.logprobs, t.versions, t.finish_reason) for t in trajectories}


def max_logprob_gap(model, trajectories, **kw) -> float:
    batch = pack_trajectories(trajectories, [0.0] * len(trajectories))
    with torch.no_grad():
        lp = token_logprobs(model, batch, temperature=T, **kw)
    return (lp - batch.old_logprobs)[batch.mask].abs().max().item()


def test_logprobs_equal_trainer_and_groups_share_the_prompt(model, prompts):
    ro = rollouts(model)
    out = ro.run(prompts, 3, seed=7)
    assert len(out.finished) == 9 and not out.unfinished
    assert max_logprob_gap(model, out.finished) <= 1e-5
    # the leader computes each prompt; its two followers resume from the prompt-end checkpoint
    assert (out.prefix_queries, out.prefix_hits) == (9, 6)
    for t in out.finished:
        assert t.segments[0].cached_tokens == (0 if t.sample == 0 else len(t.prompt_ids) - 1), t.uid
        assert t.seed == trajectory_seed(7, t.group, t.sample) and t.versions == [0] * len(t.completion_ids)
        assert (t.finish_reason == "stop") == (t.completion_ids[-1] in STOPS)
        assert t.finish_reason == "stop" or len(t.completion_ids) == MAX_TOKENS
    assert len({len(t.completion_ids) for t in out.finished}) > 3  # lengths vary: partial rollout has a tail
    # deterministic: a fresh engine over the same weights samples the same trajectories bit for bit
    assert record(rollouts(model).run(prompts, 3, seed=7).finished) == record(out.finished)
    ro.reset_cache()  # the same engine with its prefix cache dropped computes the same way
    assert record(ro.run(prompts, 3, seed=7).finished) == record(out.finished)
    assert record(ro.run(prompts, 3, seed=8).finished) != record(out.finished)
    with pytest.raises(ValueError, match="duplicate trajectory uids"):
        ro.run(prompts, 1, seed=9, resume=ro.new_trajectories(prompts, 1, seed=9))


def test_logprobs_equal_trainer_with_qat(model, prompts):
    """MXFP8 inputs round to 3 mantissa bits: the ulp-level gap between the engine's decode path and
    the packed training forward sometimes flips a rounding (gaps near 1e-3). In batch-invariant
    arithmetic on both sides every token is computed the same way, so the gap is zero."""
    qat = copy.deepcopy(model)
    assert apply_qat(qat) > 0
    out = rollouts(qat, max_tokens=8, batch_invariant=True).run([Prompt(tuple(p)) for p in prompts[:2]], 2, seed=3)
    assert len(out.finished) == 4
    assert max_logprob_gap(qat, out.finished, batch_invariant=True) <= 1e-5


@pytest.fixture(scope="module")
def two_layers():
    """k3-tiny cut to 2 layers (KDA + dense FFN, MLA + latent MoE): both kinds of paged state that a
    pause keeps, at a quarter of the depth; the synchronous reference below decodes 8 trajectories
    one at a time, in batch-invariant arithmetic."""
    torch.manual_seed(0)
    return K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=320, num_hidden_layers=2, kda_layers=[1],
                                                        full_attn_layers=[2])).eval()


def test_partial_rollout(two_layers, prompts):
    model, prompts = two_layers, prompts[:2]
    # the synchronous reference: one request at a time, no prefix cache, each trajectory alone
    reference = rollouts(model, batch_invariant=True, max_num_seqs=1, enable_prefix_caching=False)
    sync = record(reference.run(prompts, 3, seed=1).finished + reference.run(prompts[:1], 2, seed=2).finished)
    assert len(sync) == 8

    # batched, prefix-shared, and through a waiting queue of one (submissions wait for room)
    ro = rollouts(model, batch_invariant=True, max_waiting=1, max_num_seqs=4)
    full = ro.run(prompts, 3, seed=1, stop_fraction=1.0)
    assert record(full.finished) == {uid: r for uid, r in sync.items() if uid.startswith("1/")}

    ro = rollouts(model, batch_invariant=True)
    first = ro.run(prompts, 3, seed=1, stop_fraction=0.5)
    assert len(first.finished) >= 3 and first.unfinished
    assert len(first.finished) + len(first.unfinished) == 6
    paused = {t.uid: len(t.completion_ids) for t in first.unfinished}
    assert any(paused.values())  # some were paused mid-completion, with a generator state to continue from
    assert all(t.rng_state is not None for t in first.unfinished if t.completion_ids)
    ro.policy_version = 1  # (the weights did not move: the resumed tokens must be the unpaused ones)
    second = ro.run(prompts[:1], 2, seed=2, stop_fraction=0.5, resume=first.unfinished)
    assert second.prefix_hits >= len(first.unfinished)
    last = ro.run([], 2, seed=3, resume=second.unfinished)  # no new prompts: drain
    assert not last.unfinished
    for t in second.finished + last.finished:
        if t.uid in paused:  # each token carries the version that sampled it; the resumption hit the cache
            assert t.versions == [0] * paused[t.uid] + [1] * (len(t.completion_ids) - paused[t.uid])
            assert t.segments[-1].version == 1 and t.segments[-1].cached_tokens >= len(t.prompt_ids) - 1 > 0
            if paused[t.uid]:  # the engine kept its state where it paused: only the last token again
                assert t.segments[1].cached_tokens == t.segments[1].prompt_tokens - 1

    everything = first.finished + second.finished + last.finished
    counts = Counter(t.uid for t in everything)
    assert len(counts) == 8 and set(counts.values()) == {1}  # none lost, none duplicated
    assert set(counts) == set(sync)
    # same weights, batch-invariant arithmetic: pauses change nothing but the recorded versions
    split = record(everything)
    assert {uid: r[:3] + r[4:] for uid, r in split.items()} == {uid: r[:3] + r[4:] for uid, r in sync.items()}
    assert any(1 in r[3] for r in split.values()) and any(set(r[3]) == {0} for r in split.values())
