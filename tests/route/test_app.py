"""`k3 route` against stand-in replicas (tests/route/fakes.py): affinity, failover of whole replies
and of streams (resumed, or the documented error chunk), and every bad input a clear status."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.route.fakes import Fleet

CLIENT = httpx.Client(timeout=10)  # one client: building one costs more than a request here


@pytest.fixture(scope="module")
def shared_fleet():
    with Fleet(max_request_bytes=1 << 16) as f:
        yield f


@pytest.fixture
def fleet(shared_fleet):
    shared_fleet.reset()
    return shared_fleet


def chat(url: str, session: str, stream: bool = False, **kw) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **kw}
    return CLIENT.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session})


def events(r: httpx.Response) -> list:
    return [e if e == "[DONE]" else json.loads(e) for e in
            (line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: "))]


def streamed_text(evs: list) -> str:
    return "".join(c["delta"].get("content", "") for e in evs if isinstance(e, dict) for c in e.get("choices", []))


def test_a_session_stays_on_its_replica_and_sessions_spread(fleet):
    seen = {s: {chat(fleet.url, s).headers["x-k3-replica"] for _ in range(2)} for s in map(str, range(8))}
    assert all(len(r) == 1 for r in seen.values()), seen
    assert len(set().union(*seen.values())) > 1  # 8 sessions on one replica of 3: the ring is broken


def test_a_replica_that_drops_a_whole_reply_passes_it_to_the_secondary(fleet):
    primary = chat(fleet.url, "s").headers["x-k3-replica"]
    fleet.behaviour(primary).die_after = 3
    r = chat(fleet.url, "s")
    assert r.status_code == 200 and r.headers["x-k3-replica"] != primary
    assert r.json()["choices"][0]["message"]["content"] == "hello world"
    assert 'k3_route_failovers_total{reason="response"}' in CLIENT.get(fleet.url + "/metrics").text


def test_an_unhealthy_replica_is_skipped_then_taken_back(fleet):
    primary = chat(fleet.url, "s").headers["x-k3-replica"]
    fleet.behaviour(primary).healthy = False
    time.sleep(0.2)
    assert chat(fleet.url, "s").headers["x-k3-replica"] != primary
    fleet.behaviour(primary).healthy = True
    time.sleep(0.2)
    assert chat(fleet.url, "s").headers["x-k3-replica"] == primary


def test_a_stream_cut_midway_is_resumed_on_the_secondary_unseen(fleet):
    primary = chat(fleet.url, "s").headers["x-k3-replica"]
    fleet.behaviour(primary).die_after = 4
    r = chat(fleet.url, "s", stream=True)
    evs = events(r)
    assert r.status_code == 200 and evs[-1] == "[DONE]"
    assert streamed_text(evs) == "hello world"  # every character once, in order
    assert len({e["id"] for e in evs if isinstance(e, dict)}) == 1  # one stream, the first replica's id
    assert sum(1 for e in evs if isinstance(e, dict) and "role" in e["choices"][0]["delta"]) == 1
    metrics = CLIENT.get(fleet.url + "/metrics").text
    assert 'k3_route_stream_restarts_total{outcome="resumed"} 1.0' in metrics
    assert 'k3_route_failovers_total{reason="stream"} 1.0' in metrics


def test_a_stream_that_cannot_be_resumed_ends_with_the_documented_error_chunk(fleet):
    primary = chat(fleet.url, "s").headers["x-k3-replica"]
    fleet.behaviour(primary).die_after = 4
    for b in fleet.behaviours:
        if b is not fleet.behaviour(primary):
            b.text = "help!"  # the replay differs from what was sent ("hell" + "o world")
    evs = events(chat(fleet.url, "s", stream=True))
    assert streamed_text(evs) == "hell"
    assert evs[-2]["error"]["code"] == "replica_failed" and evs[-1] == "[DONE]"


def test_completions_stream_resumes_too(fleet):
    body = {"model": "m", "prompt": "abc", "stream": True, "temperature": 0}
    primary = CLIENT.post(fleet.url + "/v1/completions", json={**body, "stream": False}).headers["x-k3-replica"]
    fleet.behaviour(primary).die_after = 6
    evs = events(CLIENT.post(fleet.url + "/v1/completions", json=body))
    assert "".join(e["choices"][0]["text"] for e in evs if isinstance(e, dict)) == "hello world"


def test_all_replicas_down_is_503_naming_them(fleet):
    for b in fleet.behaviours:
        b.healthy = False
    time.sleep(0.2)
    r = chat(fleet.url, "s")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "no_replica" and all(u in err["message"] for u in fleet.urls)
    assert CLIENT.get(fleet.url + "/health").status_code == 503


@pytest.mark.parametrize("headers,body,param", [
    ({}, {"user": 5}, "user"),
    ({}, {"user": ""}, "user"),
    ({"x-session-id": "x" * 300}, {}, "X-Session-ID"),
    ({"x-session-id": "a\tb"}, {}, "X-Session-ID"),
])
def test_a_malformed_session_key_is_400(fleet, headers, body, param):
    r = CLIENT.post(fleet.url + "/v1/chat/completions", json={"model": "m", "messages": [], **body}, headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_session_key" and r.json()["error"]["param"] == param


def test_bad_bodies_are_clear_4xx(fleet):
    too_big = b'{"prompt": "' + b"x" * 100_000 + b'"}'  # past the fleet's 64 KiB limit
    big = CLIENT.post(fleet.url + "/v1/completions", content=too_big)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad = CLIENT.post(fleet.url + "/v1/completions", content=b"{nope")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    assert CLIENT.post(fleet.url + "/v1/completions", json=[1]).status_code == 400
    assert CLIENT.get(fleet.url + "/v1/nothing").json()["error"]["message"] == "Not Found"
    assert not any(b.requests for b in fleet.behaviours)  # none of them reached a replica


def test_a_long_streams_prefill_ends_at_its_first_token_and_its_budget_at_a_hang_up(fleet):
    adm = fleet.router.admission
    for b in fleet.behaviours:
        b.delay = 0.5  # each character: time to look before the first one, and after it (a loaded machine stalls)
    body = {"model": "m", "prompt": "x" * 1100, "stream": True}  # 1,100 bytes: long (the fakes have no tokenizer)
    with CLIENT.stream("POST", fleet.url + "/v1/completions", json=body) as r:
        url = r.headers["x-k3-replica"]
        assert adm.prefilling[(url, "long")] == 1 and adm.order("short", [url])[-1] == url  # short ones steer clear
        assert f'k3_route_prefilling{{class="long",replica="{url}"}} 1.0' in CLIENT.get(fleet.url + "/metrics").text
        next(r.iter_lines())
        assert adm.prefilling[(url, "long")] == 0 and adm.used[(url, "long")] == 1100  # prefilled, in flight
    deadline = time.monotonic() + 5
    while adm.used[(url, "long")]:  # the client hung up mid-stream: the budget comes back
        assert time.monotonic() < deadline, "a hung-up stream kept its admission budget"
        time.sleep(0.01)
