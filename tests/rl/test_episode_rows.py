"""An episode's one training row (k3/rl/episode_rows.py): the replies trained, the tool results
masked, and each reply token with the log-prob it has as its own turn."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.rl.episode_rows import EpisodeRow, train_rows
from k3.rl.objective import pack_trajectories, token_logprobs, trained_tokens
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)


def _turn(prompt, completion, version):
    g = torch.Generator().manual_seed(len(completion))
    return SimpleNamespace(prompt_ids=list(prompt), completion_ids=list(completion), tag={"turn": 1},
                           group_id="0/0", logprobs=(-torch.rand(len(completion), generator=g)).tolist(),
                           versions=[version] * len(completion))


def test_an_episode_trains_as_one_row():
    g = torch.Generator().manual_seed(3)
    def rand(n):
        return torch.randint(3, 320, (n,), generator=g).tolist()
    p1, c1, tool, c2, tool2, c3 = rand(70), rand(12), rand(9), rand(7), rand(5), rand(4)
    turns = [_turn(p1, c1, 4), _turn(p1 + c1 + tool, c2, 5), _turn(p1 + c1 + tool + c2 + tool2, c3, 5)]
    [row] = train_rows(turns)
    assert isinstance(row, EpisodeRow) and row.prompt_ids == p1 and row.turns == turns
    assert row.completion_ids == c1 + tool + c2 + tool2 + c3 and trained_tokens(row) == len(c1 + c2 + c3)
    assert row.versions == [4] * 12 + [-1] * 9 + [5] * 7 + [-1] * 5 + [5] * 4
    assert train_rows(turns[:1]) == turns[:1]  # a one-turn episode trains as it is
    broken = [turns[0], _turn(p1 + rand(3) + tool, c2, 5)]  # a next prompt that is not the sequence so far
    assert train_rows(broken) == broken

    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=320)).train()
    with torch.no_grad():
        one = pack_trajectories([row], [0.5])
        separate = pack_trajectories(turns, [0.5] * 3)
        merged = token_logprobs(model, one, temperature=0.8)[one.mask]
        apart = token_logprobs(model, separate, temperature=0.8)[separate.mask]
    torch.testing.assert_close(merged, apart, rtol=0, atol=1e-5)
    assert torch.equal(one.old_logprobs[one.mask], separate.old_logprobs[separate.mask])
    assert torch.equal(one.advantages[one.mask], separate.advantages[separate.mask])
    assert not one.advantages[~one.mask].any()
