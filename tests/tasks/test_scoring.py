"""Scoring replies against `expected` (whole episodes with a scripted model: tests/tasks/test_episodes.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from k3.tasks.scoring import METRICS, contains_answer, score, summarize

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

