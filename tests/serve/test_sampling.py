"""The serving sampler: a row's token does not depend on its batch (greedy rows are picked in one
batched argmax, the others on the host with their own generators), greedy is the argmax, and
logprobs are of the raw distribution."""
import torch

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
