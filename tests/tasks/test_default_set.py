"""The default SFT set: deterministic, split by template and by value, valid, and self-consistent."""
from __future__ import annotations

import json
import re

import pytest

from k3.tasks import default_set as ds
from k3.tasks.conversations import read_conversations
from k3.tasks.tools import TABLE, TOOLS, call_tool

N = 600  # per split: enough to see every kind and template, fast to generate


@pytest.fixture(scope="module")
def train():
    return ds.conversations("train", N)


@pytest.fixture(scope="module")
def heldout():
    return ds.conversations("heldout", N)


def _kind(conv) -> str:
    tool = conv["expected"]["tool"]
    if tool:
        return tool
    return "repeat" if conv["messages"][-1].get("reasoning_content") else "greeting"


def _pattern(template: str) -> re.Pattern:
    """A template as a regex over the user message, its placeholders matching anything."""
    parts = re.split(r"({[^}]+})", template)
    return re.compile("".join(".+" if p.startswith("{") else re.escape(p) for p in parts) + "$")


def _template_of(conv) -> str:
    user = conv["messages"][0]["content"]
    hits = [t for t, _ in ds.TEMPLATES[_kind(conv)] if _pattern(t).match(user)]
    assert len(hits) == 1, (user, hits)
    return hits[0]


def _item(conv) -> str | None:
    kind, exp = _kind(conv), conv["expected"]
    if kind == "greeting":
        return None
    if kind == "repeat":
        return f"repeat|{exp['answer']}"
    return f"{kind}|{json.dumps(exp['arguments'], sort_keys=True)}"


def test_deterministic():
    assert ds.conversations("train", 50, seed=3) == ds.conversations("train", 50, seed=3)
    assert ds.conversations("heldout", 50) == ds.conversations("heldout", 50)
    assert ds.conversations("train", 50, seed=3) != ds.conversations("train", 50, seed=4)
    assert ds.conversations("train", 20) == ds.conversations("train", 50)[:20]  # a prefix: n only adds


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        ds.conversations("test", 3)
    with pytest.raises(ValueError, match="n_tools"):
        ds.conversations("train", 3, n_tools=0)


def test_every_kind_and_template_appears(train, heldout):
    assert {_kind(c) for c in train} == set(ds.TEMPLATES) == {_kind(c) for c in heldout}
    assert {_template_of(c) for c in train} == {t for k in ds.TEMPLATES.values() for t, only in k if not only}
    assert {_template_of(c) for c in heldout} == {t for k in ds.TEMPLATES.values() for t, _ in k}


def test_heldout_templates_never_in_train(train):
    heldout_only = {t for k in ds.TEMPLATES.values() for t, only in k if only}
    assert heldout_only
    users = [c["messages"][0]["content"] for c in train]
    for t in heldout_only:
        assert not any(_pattern(t).match(u) for u in users), t


def test_heldout_values_disjoint_from_train(train, heldout):
    train_items = {_item(c) for c in train} - {None}
    heldout_items = {_item(c) for c in heldout} - {None}
    assert heldout_items and not train_items & heldout_items
    # whole places and whole unit pairs are held out too
    assert _places(heldout) and not _places(train) & _places(heldout)
    assert ds.HELDOUT_PAIRS <= _pairs(heldout) and not ds.HELDOUT_PAIRS & _pairs(train)


def _places(convs) -> set[str]:
    return {c["expected"]["arguments"]["key"].split(" of ")[1] for c in convs if _kind(c) == "lookup"}


def _pairs(convs) -> set[tuple[str, str]]:
    return {(c["expected"]["arguments"]["from"], c["expected"]["arguments"]["to"]) for c in convs
            if _kind(c) == "convert"}


def test_heldout_answerable(heldout):
    for c in heldout:
        exp = c["expected"]
        if exp["tool"] == "lookup":
            assert exp["arguments"]["key"] in TABLE
        if exp["tool"]:
            assert not call_tool(exp["tool"], exp["arguments"]).startswith("error")
            assert exp["tool"] in [t["function"]["name"] for t in c["tools"]]


def test_roundtrip_through_reader(tmp_path, train, heldout):
    for split, convs in (("train", train), ("heldout", heldout)):
        path = ds.write_jsonl(tmp_path / f"{split}.jsonl", convs)
        read = read_conversations(path)
        assert [r.messages for r in read] == [c["messages"] for c in convs]
        assert [r.expected for r in read] == [c["expected"] for c in convs]
        assert [r.line for r in read] == list(range(1, len(convs) + 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heldout.jsonl", "train.jsonl"]  # no temp files left


def test_tool_results_and_answers_consistent(train, heldout):
    for c in train + heldout:
        msgs, exp = c["messages"], c["expected"]
        assert msgs[0]["role"] == "user" and msgs[-1]["role"] == "assistant"
        assert exp["answer"] in msgs[-1]["content"]
        assert 1 <= len(c["tools"]) == ds.DEFAULT_N_TOOLS
        if exp["tool"] is None:
            assert len(msgs) == 2 and "tool_calls" not in msgs[1]
            continue
        call = msgs[1]["tool_calls"][0]
        assert call["function"]["name"] == exp["tool"]
        assert json.loads(call["function"]["arguments"]) == exp["arguments"]
        assert msgs[2] == {"role": "tool", "tool_call_id": call["id"],
                           "content": call_tool(exp["tool"], call["function"]["arguments"])}
        assert msgs[2]["content"] == exp["answer"]
        # the arguments are copied from the question: every argument value appears in it
        assert all(str(v) in msgs[0]["content"] for v in exp["arguments"].values())


def test_n_tools_and_lengths():
    for n_tools in (1, 2, 3):
        convs = ds.conversations("train", 100, n_tools=n_tools)
        assert all(len(c["tools"]) == n_tools for c in convs)
    # the whole conversation stays small (tools included): the set is for a tiny model
    sizes = [len(json.dumps(c)) for c in ds.conversations("train", 200)]
    assert max(sizes) < 1300
    assert all(t["function"]["parameters"]["additionalProperties"] is False for t in TOOLS)
    convs[0]["tools"][0]["function"]["name"] = "edited"  # each conversation owns its declarations
    assert "edited" not in [t["function"]["name"] for t in TOOLS]


def test_load_gives_checked_conversations():
    convs = ds.load("heldout", 30, seed=1)
    assert [c.messages for c in convs] == [c["messages"] for c in ds.conversations("heldout", 30, seed=1)]
    assert convs[0].where == "default-set:heldout:1" and all(c.expected for c in convs)
