"""The serving sampler: a row's token does not depend on its batch (greedy rows are picked in one
batched argmax, the others on the host with their own generators), greedy is the argmax, and
logprobs are of the raw distribution. Sampling is numerically safe for every value the API accepts,
and a row that still fails (non-finite logits) fails alone."""
import torch

from k3.sampling import sample_next
from k3.serve.sampling import Sampler, SamplingParams

PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, seed=3),
          SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
          SamplingParams(temperature=1.2, top_p=0.9, seed=11)]


def test_each_row_samples_as_it_would_alone():
    logits = torch.randn(len(PARAMS), 97, generator=torch.Generator().manual_seed(0))
    ids = [f"r{n}" for n in range(len(PARAMS))]
    batched = Sampler().sample(logits, ids, PARAMS)
    alone = [Sampler().sample(logits[n:n + 1], [ids[n]], [p])[0] for n, p in enumerate(PARAMS)]
    assert [s.token_id for s in batched] == [s.token_id for s in alone]
    for n in (0, 2, 3):
        assert batched[n].token_id == int(logits[n].argmax())
    raw = torch.log_softmax(logits[2], -1)
    assert abs(batched[2].logprob - float(raw[batched[2].token_id])) < 1e-6
    assert [t for t, _ in batched[2].top_logprobs] == raw.topk(3).indices.tolist()
    assert batched[0].logprob is None and batched[1].top_logprobs is None


def test_greedy_batch_in_the_logits_dtype():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tokens = Sampler().sample(logits, list("abcd"), [SamplingParams(temperature=0.0)] * 4)
    assert [s.token_id for s in tokens] == logits.float().argmax(-1).tolist()


# ---------------------------------------------------------------------- hostile parameters
TINY = [5e-324, 1e-46, 1e-40, 1e-38, 2e-38, 1e-30]  # all accepted by the API's temperature in [0, 2]


def test_tiny_temperature_is_greedy_not_nan():
    """1/temperature overflowed fp32: inf logits, NaN probabilities, and multinomial raised."""
    logits = torch.randn(3, 97, generator=torch.Generator().manual_seed(2))
    for t in TINY:
        tokens = sample_next(logits, temperature=t, generator=torch.Generator().manual_seed(0))
        assert tokens.tolist() == logits.argmax(-1).tolist(), t


def test_tiny_top_p_keeps_the_top_token():
    """A top_p that rounds to 0 in fp32 dropped every token (all -inf: NaN probabilities)."""
    logits = torch.randn(3, 97, generator=torch.Generator().manual_seed(3))
    for p in (5e-324, 7e-46, 1e-45, 1e-12):
        for t in (1.0, 2.0, 1e-40):
            tokens = sample_next(logits, temperature=t, top_p=p, top_k=5, generator=torch.Generator().manual_seed(0))
            assert tokens.tolist() == logits.argmax(-1).tolist(), (p, t)


def test_sampling_distribution_unchanged_by_the_max_shift():
    """Shifting logits by their row max before the temperature leaves the distribution as it was."""
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(4)) * 3
    gen = torch.Generator().manual_seed(5)
    draws = torch.cat([sample_next(logits, temperature=0.7, generator=gen) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=8).float() / 4000
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert (counts - expected).abs().max() < 0.03


def test_a_failing_row_fails_alone():
    """Non-finite logits make multinomial raise: that row gets an error, its batch-mates their tokens."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    logits[1] = float("nan")
    params = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.9, seed=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2)]
    out = Sampler().sample(logits, list("abcd"), params)
    assert out[1].error and "sampling failed" in out[1].error
    assert all(out[n].error is None for n in (0, 2, 3))
    assert out[0].token_id == Sampler().sample(logits[:1], ["a"], params[:1])[0].token_id
    assert [out[2].token_id, out[3].token_id] == logits[2:].argmax(-1).tolist()


def test_seeds_apart_by_2_to_the_32_draw_different_streams():
    """torch's CPU generator keeps a seed's low 32 bits; the API takes 64-bit seeds."""
    logits = torch.randn(1, 5000)
    draws = {}
    for seed in (5, 2**32 + 5, -(2**32) + 5):
        sampler = Sampler()
        p = SamplingParams(temperature=1.0, seed=seed)
        draws[seed] = [sampler.sample(logits, ["r"], [p])[0].token_id for _ in range(8)]
    assert len({tuple(v) for v in draws.values()}) == 3, draws
