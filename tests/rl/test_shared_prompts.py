"""Shared prompts in the RL trainer's forward (k3/rl/shared_prompts.py): the same log-probs and
gradients as the whole packed forward, bit for bit in batch-invariant mode, and the whole forward
where nothing is shared."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.ops.batch_invariant import batch_invariant
from k3.rl.objective import pack_trajectories, token_logprobs
from k3.rl.shared_prompts import prompt_split, shared_prompt_logits
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)


def _traj(prompt, completion, trains=None):
    return SimpleNamespace(prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * len(completion),
                           versions=[0] * len(completion), completion_mask=trains)


def _groups(seed: int = 5):
    """Two groups of 3 samples (prompts of 70 and 9 tokens: past a KDA chunk and within one) and one
    lone trajectory, completions of 1-40 tokens, one with untrained tokens inside (a tool episode's
    row, k3/rl/episode_rows.py), interleaved as a trainer's rows may be."""
    g = torch.Generator().manual_seed(seed)
    def rand(n: int) -> list[int]:
        return torch.randint(3, 320, (n,), generator=g).tolist()

    a, b = rand(70), rand(9)
    trajs = [_traj(a, rand(40)), _traj(b, rand(1)), _traj(a, rand(7)), _traj(rand(30), rand(12)),
             _traj(b, rand(23), [True] * 6 + [False] * 9 + [True] * 8), _traj(a, rand(16)), _traj(b, rand(5))]
    return pack_trajectories(trajs, torch.randn(len(trajs), generator=g).tolist())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=320)).train()


def _grads(model, batch, share: bool):
    model.zero_grad(set_to_none=True)
    lp = token_logprobs(model, batch, temperature=0.8, share_prompts=share)
    (lp * batch.advantages).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), grads


def test_shared_prompts_equal_the_whole_forward(model):
    batch = _groups()
    whole, g_whole = _grads(model, batch, share=False)
    shared, g_shared = _grads(model, batch, share=True)
    assert torch.count_nonzero(whole) == batch.mask.sum()
    torch.testing.assert_close(shared, whole, rtol=0, atol=1e-5)
    assert g_shared.keys() == g_whole.keys()
    for name, g in g_whole.items():  # every parameter's gradient, relative to its own size
        err = (g_shared[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-4, (name, float(err))


def test_shared_prompts_are_bit_exact_in_batch_invariant_mode(model):
    batch = _groups(seed=7)
    with torch.no_grad(), batch_invariant():
        whole = token_logprobs(model, batch, share_prompts=False)
        shared = token_logprobs(model, batch, share_prompts=True)
    assert torch.equal(shared, whole)


def test_nothing_shared_falls_back_to_the_whole_forward(model):
    distinct = pack_trajectories([_traj([10, 11, 12, 13], [5, 6]), _traj([20, 21, 22, 23, 24, 25], [7, 8])],
                                 [1.0, -1.0])
    assert prompt_split(distinct) is not None and shared_prompt_logits(model, distinct) is None
    one_token = pack_trajectories([_traj([7], [5, 6]), _traj([7], [8])], [1.0, -1.0])
    assert prompt_split(one_token) is None  # a one-token prompt leaves nothing to share
