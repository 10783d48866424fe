"""Resuming a stream: the replay's text already sent is skipped, a chunk straddling the resume point
is cut, and a replay that differs is refused."""
from __future__ import annotations

import json

import pytest

from k3.route.resume import Diverged, Transcript


def chunk(text=None, reasoning=None, finish=None, rid="a"):
    delta = {k: v for k, v in (("content", text), ("reasoning", reasoning), ("reasoning_content", reasoning)) if v}
    return json.dumps({"id": rid, "created": 1, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_replay_skips_what_was_sent_and_cuts_the_straddling_chunk():
    t = Transcript()
    assert t.pass_on(chunk(reasoning="th")) and t.pass_on(chunk(text="ab"))
    t.restart()
    assert t.pass_on(chunk(reasoning="t", rid="b")) is None
    assert t.pass_on(chunk(reasoning="h", rid="b")) is None
    out = json.loads(t.pass_on(chunk(text="abcd", rid="b")))
    assert out["id"] == "a" and out["choices"][0]["delta"] == {"content": "cd"}
    assert json.loads(t.pass_on(chunk(finish="stop", rid="b")))["choices"][0]["finish_reason"] == "stop"


def test_a_different_or_shorter_replay_diverges():
    t = Transcript()
    t.pass_on(chunk(text="abc"))
    t.restart()
    with pytest.raises(Diverged):
        t.pass_on(chunk(text="ax"))
    t = Transcript()
    t.pass_on(chunk(text="abc"))
    t.restart()
    t.pass_on(chunk(text="a"))
    with pytest.raises(Diverged):
        t.pass_on(chunk(finish="stop"))
