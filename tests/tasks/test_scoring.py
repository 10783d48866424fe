"""Scoring replies against `expected`, and a whole agent episode with a scripted model."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from k3.tasks import default_set as ds
from k3.tasks.scoring import METRICS, agent_episode, contains_answer, score, summarize
from k3.tasks.tools import TOOLS, call_tool

EXPECTED = {"tool": "convert", "arguments": {"value": 3, "from": "km", "to": "m"}, "answer": "3000 m"}
PLAIN = {"tool": None, "arguments": None, "answer": "gold key"}


@dataclass
class FakeReply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    complete: bool = True


def _call(name="convert", arguments='{"value": 3, "from": "km", "to": "m"}', id="call_1"):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _first(**kw):
    return FakeReply(reasoning="I will use convert.", tool_calls=[_call(**kw)])


FINAL = FakeReply(content="3 km is 3000 m.")
ALL_TRUE = dict.fromkeys(METRICS, True)


def test_perfect_tool_episode():
    assert score(EXPECTED, _first(), FINAL) == ALL_TRUE
    # numbers compare by value, arguments may arrive already parsed, key order does not matter
    assert score(EXPECTED, _first(arguments='{"to": "m", "from": "km", "value": 3.0}'), FINAL) == ALL_TRUE
    assert score(EXPECTED, _first(arguments={"value": 3, "from": "km", "to": "m"}), FINAL) == ALL_TRUE


def test_wrong_tool():
    s = score(EXPECTED, _first(name="calculator", arguments='{"expression": "3"}'), FINAL)
    assert not s["right_tool"] and not s["valid_arguments"] and not s["tool_ok"]
    s = score(EXPECTED, FakeReply(content="3000 m"), None)  # no call at all
    assert not s["right_tool"] and not s["tool_ok"] and not s["answer_correct"] and s["valid_xtml"]
    s = score(EXPECTED, FakeReply(tool_calls=[_call(), _call(name="lookup", arguments='{"key": "x"}')]), FINAL)
    assert not s["right_tool"]


@pytest.mark.parametrize("arguments", [
    '{"value": 3, "from": "km", "to": ',  # invalid JSON
    '[3, "km", "m"]',  # not an object
    '{"value": "3", "from": "km", "to": "m"}',  # schema: value must be a number
    '{"value": 3, "from": "km"}',  # schema: "to" is required
    '{"value": 3, "from": "km", "to": "m", "x": 1}',  # schema: additionalProperties false
    '{"value": true, "from": "km", "to": "m"}',  # a boolean is no number
    '{"value": 4, "from": "km", "to": "m"}',  # valid, but the wrong value
    '{"value": 3, "from": "m", "to": "km"}',  # valid, units swapped
])
def test_bad_arguments(arguments):
    s = score(EXPECTED, _first(arguments=arguments), FINAL)
    assert s["right_tool"] and not s["valid_arguments"] and not s["tool_ok"]


def test_wrong_answer():
    for content in ("3 km is 300 m.", "13000 m", "3000 meters", "", "-3000 m"):
        assert not score(EXPECTED, _first(), FakeReply(content=content))["answer_correct"], content
    assert score(EXPECTED, _first(), FakeReply(content="It is 3000 m!"))["answer_correct"]
    assert contains_answer("The answer is -108.", "-108") and not contains_answer("The answer is 108.", "-108")
    assert not contains_answer("84.5", "84") and contains_answer("84.", "84")


def test_errors_or_incomplete_are_not_valid():
    assert not score(EXPECTED, FakeReply(tool_calls=[_call()], errors=["unclosed tag"]), FINAL)["valid_xtml"]
    assert not score(EXPECTED, _first(), FakeReply(content="3 km is 3000 m.", complete=False))["valid_xtml"]
    assert not score(EXPECTED, FakeReply(tool_calls=[_call()], complete=False), FINAL)["valid_xtml"]


def test_plain_answers():
    assert score(PLAIN, FakeReply(content="gold key"), None) == ALL_TRUE
    s = score(PLAIN, FakeReply(tool_calls=[_call()]), FakeReply(content="gold key"))
    assert not s["right_tool"] and not s["tool_ok"] and not s["answer_correct"]
    assert not score(PLAIN, FakeReply(content="gold"), None)["answer_correct"]


def test_summarize():
    scores = [ALL_TRUE, dict(ALL_TRUE, answer_correct=False), dict.fromkeys(METRICS, False), ALL_TRUE]
    out = summarize(scores)
    assert out["n"] == 4 and out["valid_xtml"] == 0.75 and out["answer_correct"] == 0.5
    assert summarize([]) == dict(dict.fromkeys(METRICS, 0.0), n=0.0)


def _oracle(conv):
    """A scripted model that replies exactly as the conversation's own assistant turns do."""
    assistant = [m for m in conv["messages"] if m["role"] == "assistant"]
    seen = []

    def reply_fn(messages, tools):
        assert tools == conv["tools"]
        assert messages == conv["messages"][:len(messages)]  # the episode rebuilds the conversation exactly
        m = assistant[len(seen)]
        seen.append(m)
        return FakeReply(content=m.get("content") or "", reasoning=m.get("reasoning_content") or "",
                         tool_calls=m.get("tool_calls") or [])
    return reply_fn, seen


def test_agent_episode_perfect_model():
    convs = ds.conversations("heldout", 60)
    for conv in convs:
        reply_fn, seen = _oracle(conv)
        assert agent_episode(conv, reply_fn) == ALL_TRUE, conv["messages"][0]
        assert len(seen) == (2 if conv["expected"]["tool"] else 1)


def test_agent_episode_takes_dataset_conversations():
    for conv in ds.load("heldout", 10):
        as_dict = {"messages": conv.messages, "tools": conv.tools}
        reply_fn, _ = _oracle(as_dict)
        assert agent_episode(conv, reply_fn) == ALL_TRUE


def test_agent_episode_runs_the_models_own_call():
    conv = next(c for c in ds.conversations("heldout", 50) if c["expected"]["tool"] == "calculator")
    got = []

    def reply_fn(messages, tools):
        got.append(messages)
        if len(got) == 1:
            return FakeReply(tool_calls=[_call("calculator", '{"expression": "2 * 21"}')])
        return FakeReply(content=f"The answer is {messages[-1]['content']}.")

    s = agent_episode(conv, reply_fn)
    assert got[1][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    assert call_tool("calculator", {"expression": "2 * 21"}) == "42"
    assert s["right_tool"] and s["valid_xtml"] and not s["valid_arguments"]
    assert s["answer_correct"] == (conv["expected"]["answer"] == "42")


def test_agent_episode_needs_expected():
    conv = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    with pytest.raises(ValueError, match="expected"):
        agent_episode(conv, lambda m, t: FakeReply())
    assert json.dumps(conv)  # untouched and serializable
