"""Episodes token in / token out (k3/rl/episodes.py): the next turn's prompt extends the sampled
sequence exactly, even where a re-rendered reply would tokenize differently, and an episode's one
training row gives each reply token the log-prob it has as its own turn."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.rl.episodes import EpisodeRow, next_turn, train_rows
from k3.rl.objective import pack_trajectories, token_logprobs, trained_tokens
from k3.tasks.domains import make_domain
from k3.text.tokenizer import train_tokenizer
from k3.text.xtml import XTML
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def chat():
    tasks = make_domain("tool").tasks("train", 30)
    return XTML(train_tokenizer([json.dumps([t.messages, t.reference, t.tools]) for t in tasks], 600))


def _split_a_token(tokenizer, ids: list[int], start: int) -> list[int]:
    """`ids` with one multi-letter token from `start` on spelled letter by letter: the same text, a
    tokenization BPE would never produce."""
    for k in range(start, len(ids)):
        text = tokenizer.decode([ids[k]])
        pieces = [tokenizer.token_to_id(c) for c in text]
        if len(text) > 1 and text.isalpha() and all(p is not None for p in pieces):
            return ids[:k] + pieces + ids[k + 1:]
    raise AssertionError("no multi-letter token to split")


def test_next_turn_extends_the_sampled_ids(chat):
    task = make_domain("tool").task("train", 0)
    call = next(m for m in task.reference if m.get("tool_calls"))
    prompt = task.render(chat, None, "max")
    canonical = chat.render(task.messages + [call], tools=task.tools, reasoning_effort="max",
                            add_generation_prompt=False).token_ids[len(prompt.token_ids):]
    sampled = _split_a_token(chat.tokenizer, canonical, 0)
    reply = chat.parse_reply(prompt, sampled)
    assert reply.tool_calls and not reply.errors and reply.reasoning == chat.parse_reply(prompt, canonical).reasoning
    nxt = next_turn(chat, task, "max", None, reply, prompt.token_ids, sampled, prompt.boundaries)
    base = prompt.token_ids + sampled
    rerendered = nxt.rendered.token_ids  # the old way: the reply re-encoded from its messages
    assert nxt.token_ids[:len(base)] == base and rerendered[:len(base)] != base
    assert nxt.token_ids[len(base):] == rerendered[len(prompt.token_ids) + len(canonical):]
    assert nxt.boundaries[:len(prompt.boundaries)] == prompt.boundaries and len(base) in nxt.boundaries
    assert nxt.messages[-1]["role"] == "tool" and nxt.messages[-1]["content"] == task.answer


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
