"""The one episode runner (k3/tasks/episodes.py): the next turn's prompt extends the sampled sequence
exactly, even where a re-rendered reply would tokenize differently; a held-out SFT conversation
played by a scripted model rebuilds the conversation token for token and scores as `score` does."""
from __future__ import annotations

import json

import pytest

from k3.tasks import default_set as ds
from k3.tasks.domains import make_domain
from k3.tasks.episodes import next_turn, play_episodes
from k3.tasks.scoring import METRICS, ConversationTask, summarize_episodes
from k3.text.tokenizer import train_tokenizer
from k3.text.xtml import XTML

ALL_TRUE = dict.fromkeys(METRICS, True)


@pytest.fixture(scope="module")
def chat():
    tasks = make_domain("tool").tasks("train", 30)
    texts = [json.dumps([t.messages, t.reference, t.tools]) for t in tasks]
    texts += [json.dumps(c) for c in ds.conversations("heldout", 30)]
    return XTML(train_tokenizer(texts, 600))


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


def _reply_ids(chat, messages: list[dict], tools, k: int) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids) of assistant message `k` as rendered after the messages before it."""
    prompt = chat.render(messages[:k], tools=tools).token_ids
    whole = chat.render(messages[:k + 1], tools=tools, add_generation_prompt=False).token_ids
    return list(prompt), list(whole[len(prompt):])


def _scripted(chat, turns_of: list[list[tuple[list[int], list[int]]]]):
    """A `complete` that answers turn t of each episode still running with its scripted reply, after
    checking that the runner built exactly the scripted prompt."""
    def complete(prompts, turn):
        running = [t for t in turns_of if len(t) >= turn]
        assert [p for p, _ in (t[turn - 1] for t in running)] == prompts
        return [t[turn - 1][1] for t in running]
    return complete


@pytest.mark.parametrize("as_dataset", [False, True])
def test_a_perfect_model_rebuilds_each_conversation_and_scores_all_true(chat, as_dataset):
    convs = ds.load("heldout", 30) if as_dataset else ds.conversations("heldout", 30)
    tasks = [ConversationTask(c) for c in convs]
    script = []
    for c in convs:
        messages = c.messages if as_dataset else c["messages"]
        tools = c.tools if as_dataset else c["tools"]
        script.append([_reply_ids(chat, messages, tools, k) for k, m in enumerate(messages) if m["role"] == "assistant"])
    episodes = play_episodes(_scripted(chat, script), chat, tasks, None)
    assert all(e.score == ALL_TRUE for e in episodes), [e.task.id for e in episodes if e.score != ALL_TRUE]
    assert [len(e.turns) for e in episodes] == [len(s) for s in script]
    assert {len(s) for s in script} == {1, 2}  # plain answers and tool episodes both played
    summary, records = summarize_episodes(episodes, chat.tokenizer)
    assert summary["n"] == 30 and summary["tool_prompts_tool_ok"] == 1.0
    assert records[1]["line"] == (2 if as_dataset else None) and records[1]["valid_xtml"]
    assert all((r["final"] is None) == (len(e.turns) == 1) for r, e in zip(records, episodes))


def test_the_episode_runs_the_models_own_call(chat):
    conv = next(c for c in ds.conversations("heldout", 50) if c["expected"]["tool"] == "calculator")
    task = ConversationTask(conv)
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 * 21"}'}}
    first = task.messages + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    then = first + [{"role": "tool", "tool_call_id": "call_1", "content": "42"},
                    {"role": "assistant", "content": "The answer is 42."}]
    script = [[_reply_ids(chat, first, task.tools, len(first) - 1), _reply_ids(chat, then, task.tools, len(then) - 1)]]
    [episode] = play_episodes(_scripted(chat, script), chat, [task], None)  # the scripted prompts hold the "42"
    s = episode.score
    assert s["right_tool"] and s["valid_xtml"] and not s["valid_arguments"]
    assert s["answer_correct"] == (conv["expected"]["answer"] == "42")


def test_max_turns_caps_an_episode(chat):
    conv = next(c for c in ds.conversations("heldout", 50) if c["expected"]["tool"])
    task = ConversationTask(conv)
    script = [[_reply_ids(chat, conv["messages"], conv["tools"], 1)]]
    [episode] = play_episodes(_scripted(chat, script), chat, [task], None, max_turns=1)
    assert len(episode.turns) == 1 and episode.replies[0].tool_calls and not episode.score["answer_correct"]


def test_a_conversation_task_needs_expected():
    conv = {"messages": [{"role": "user", "content": "hi"}], "tools": None}
    with pytest.raises(ValueError, match="expected"):
        ConversationTask(conv)
    assert json.dumps(conv)  # untouched and serializable
