"""The OpenAI-compatible server on a real uvicorn on 127.0.0.1 (random free port), driven by the
unmodified `openai` client: completions and chat, streaming and not, tool calls and reasoning,
errors (OpenAI JSON, 4xx only, fuzzed bodies), API key, and pages freed on client disconnect."""
from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.text.tokenizer import train_tokenizer
from k3.text.xtml import XTML
from tests.serve.fakes import ScriptedModel, one_torch_thread, scripted_chat_model  # noqa: F401 (autouse fixture)

CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is the weather in Paris today?",
          '{"name": "get_weather", "arguments": {"city": "Paris"}}'] * 4
REPLY = {"role": "assistant", "reasoning_content": "look it up", "content": "Checking.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWER = {"role": "assistant", "reasoning_content": "read the result", "content": "It is sunny, 21 C in Paris."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
KEY = "test-key"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, 330)


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """k3-tiny at random init behind a server."""
    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=tokenizer.get_vocab_size())).eval()
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=512))
    with ServerThread(build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="k3-tiny")) as server:
        yield server, engine


@pytest.fixture(scope="module")
def scripted(tokenizer):
    """A stand-in model that answers REPLY (reasoning and a tool call), and ANSWER after a tool
    result, behind an API key."""
    model = scripted_chat_model(tokenizer, REPLY, after_tool=ANSWER)
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=2048, max_num_seqs=8))
    app = build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="scripted", api_key=KEY)
    with ServerThread(app) as server:
        yield server, engine


def client(server, key="none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def wait_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.scheduler.requests or engine.cache.pool.num_used:
        assert time.monotonic() < deadline, "requests or pages still held"
        time.sleep(0.05)


# ---------------------------------------------------------------------- happy paths
def test_models_health_metrics(tiny):
    server, _ = tiny
    assert [m.id for m in client(server).models.list().data] == ["k3-tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completions_stream_equals_non_stream(tiny):
    server, engine = tiny
    c = client(server)
    full = c.completions.create(model="k3-tiny", prompt="The quick brown fox", max_tokens=5, temperature=0,
                                extra_body={"ignore_eos": True}, logprobs=2)
    assert full.usage.completion_tokens == 5 and full.choices[0].finish_reason == "length"
    assert len(full.choices[0].logprobs.token_logprobs) == 5
    chunks = list(c.completions.create(model="k3-tiny", prompt="The quick brown fox", max_tokens=5, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # the resend hit the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1
    wait_idle(engine)
    text = httpx.get(server.url + "/metrics").text
    for name in ("k3_requests_running", "k3_requests_waiting", "k3_cache_usage", "k3_prefix_cache_queries_total",
                 "k3_prefix_cache_hits_total", "k3_time_to_first_token_seconds_bucket",
                 "k3_inter_token_latency_seconds_bucket", "k3_generation_tokens_total",
                 'k3_runner_steps_total{kind="packed"}'):
        assert name in text, name


def test_chat_stream_and_not(tiny):
    server, engine = tiny
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}]
    full = c.chat.completions.create(model="k3-tiny", messages=messages, max_tokens=6, temperature=0,
                                     reasoning_effort="medium")
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens <= 6
    stream = c.chat.completions.create(model="k3-tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, reasoning_effort="medium")
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"model": "k3-tiny", "messages": messages, "max_tokens": 2, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    wait_idle(engine)


def _streamed(c, **kw) -> tuple[list, str, str, str | None, list]:
    """(tool calls assembled by index, reasoning, content, finish reason, tool_call_errors) of a stream."""
    calls, reasoning, content, finish, errors = {}, "", "", None, []
    for ch in c.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for t in d.tool_calls or []:
            have = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
            have["arguments"] += t.function.arguments or ""
        reasoning += (d.model_extra or {}).get("reasoning") or ""
        content += d.content or ""
        errors += (d.model_extra or {}).get("tool_call_errors") or []
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], reasoning, content, finish, errors


def test_agent_loop_with_the_openai_client(scripted, tokenizer):
    """Tools offered -> tool_calls; the client runs the tool and sends the result -> the answer.
    Streaming and non-streaming give the same thing at every step."""
    server, engine = scripted
    c = client(server, KEY)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    full = c.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, temperature=0)
    msg, choice = full.choices[0].message, full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert msg.content == "Checking." and msg.model_extra["reasoning"] == "look it up"
    assert msg.model_extra["reasoning_content"] == "look it up"  # the older name, for older clients
    (call,) = msg.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("functions.get_weather:1", "get_weather",
                                                                                 {"city": "Paris"})
    calls, reasoning, content, finish, _ = _streamed(c, model="scripted", messages=messages, tools=TOOLS,
                                                     temperature=0)
    assert calls == [{"id": call.id, "name": call.function.name, "arguments": call.function.arguments}]
    assert (reasoning, content, finish) == ("look it up", "Checking.", "tool_calls")
    # the returned message re-renders to exactly the tokens the model produced
    chat = XTML(tokenizer)
    assistant = msg.model_dump(exclude_none=True)
    rendered = chat.render(messages + [assistant], tools=TOOLS, add_generation_prompt=False).token_ids
    assert rendered == chat.render(messages + [REPLY], tools=TOOLS, add_generation_prompt=False).token_ids
    # the client runs the tool and sends its result: the reply carries the answer
    messages += [assistant, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = c.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, temperature=0)
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content == "It is sunny, 21 C in Paris."
    calls, reasoning, content, finish, _ = _streamed(c, model="scripted", messages=messages, tools=TOOLS,
                                                     temperature=0)
    assert (calls, reasoning, content, finish) == ([], "read the result", "It is sunny, 21 C in Paris.", "stop")
    wait_idle(engine)


def test_tool_choice_and_checked_calls(scripted):
    server, engine = scripted
    c = client(server, KEY)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # no tools offered (or tool_choice none): a call the model makes anyway is not a tool call
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        plain = c.chat.completions.create(model="scripted", messages=messages, temperature=0, **kw)
        m = plain.choices[0].message
        assert m.tool_calls is None and plain.choices[0].finish_reason == "stop"
        assert m.model_extra["tool_call_errors"], m
    # a declared schema the call does not satisfy: left out, reason given, streamed the same way
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 3}}}}}]
    bad = c.chat.completions.create(model="scripted", messages=messages, tools=strict, temperature=0)
    (error,) = bad.choices[0].message.model_extra["tool_call_errors"]
    assert bad.choices[0].message.tool_calls is None and "parameters" in error["error"]
    assert _streamed(c, model="scripted", messages=messages, tools=strict, temperature=0)[4] == [error]
    # required / named are accepted (the prompt forces a call; the scripted model ignores it)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, tool_choice=choice,
                                      temperature=0, max_tokens=8)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # thinking off renders no think channel: the scripted think text is then just content
    off = c.chat.completions.create(model="scripted", messages=messages, temperature=0, max_tokens=8,
                                    extra_body={"chat_template_kwargs": {"thinking": False}})
    assert off.choices[0].message.model_extra.get("reasoning") is None
    wait_idle(engine)


def test_chat_stop_strings_cut_the_content_only(scripted):
    """A stop string ends the content the client sees, there and then (the request's pages freed),
    streamed or not; the reasoning and the format's tag names ("response", "call") never match."""
    server, engine = scripted
    c = client(server, KEY)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    cases = [("king", "look it up", "Chec", "stop", []),  # REPLY: reasoning "look it up", content "Checking."
             ("it up", "look it up", "Checking.", "tool_calls", ["get_weather"]),  # only in the reasoning
             ("response", "look it up", "Checking.", "tool_calls", ["get_weather"]),  # only a tag name
             ("call", "look it up", "Checking.", "tool_calls", ["get_weather"]),
             (".", "look it up", "Checking", "stop", [])]
    for stop, reasoning, content, finish, calls in cases:
        r = c.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, temperature=0, stop=stop)
        m = r.choices[0].message
        assert (m.model_extra["reasoning"], m.content, r.choices[0].finish_reason) == (reasoning, content, finish), stop
        assert [t.function.name for t in m.tool_calls or ()] == calls, stop
        streamed = _streamed(c, model="scripted", messages=messages, tools=TOOLS, temperature=0, stop=stop)
        assert ([t["name"] for t in streamed[0]], *streamed[1:4]) == (calls, reasoning, content, finish), stop
    wait_idle(engine)


def test_chat_logprob_bytes_rebuild_a_reply_of_split_characters(tokenizer):
    """Characters this tokenizer never saw are split over byte tokens: each token's text is then
    U+FFFD, but its `bytes` are its own, so the content tokens' bytes joined are the content."""
    content = "Sunny \u2600 and caf\u00e9 \U0001F600."
    model = scripted_chat_model(tokenizer, {"role": "assistant", "content": content})
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=2048))
    with ServerThread(build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="m")) as server:
        r = client(server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Weather?"}], temperature=0, logprobs=True,
            top_logprobs=2)
    assert r.choices[0].message.content == content
    entries = r.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in entries)
    assert content.encode() in joined and any(e.token == "\ufffd" for e in entries)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].bytes for e in entries)


def test_default_chat_template_kwargs(tokenizer, tmp_path):
    """`--default-chat-template-kwargs` (and a run trained thinking-off) renders requests that send no
    chat_template_kwargs thinking off; a request's own kwargs still win; bad defaults are one line."""
    from k3.serve.loading import run_chat_defaults

    model = scripted_chat_model(tokenizer, REPLY, after_tool=ANSWER)
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=2048))
    app = build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="scripted",
                    default_chat_template_kwargs={"thinking": False})
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}]
    with ServerThread(app) as server:
        c = client(server)
        plain = c.chat.completions.create(model="scripted", messages=messages, temperature=0, max_tokens=8)
        assert plain.choices[0].message.model_extra.get("reasoning") is None
        on = c.chat.completions.create(model="scripted", messages=messages, temperature=0, max_tokens=64,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
        assert on.choices[0].message.model_extra.get("reasoning") == REPLY["reasoning_content"]
    for bad in ({"thinking": "no"}, {"enable_thinking": False}):
        with pytest.raises(ValueError, match="default chat template kwargs") as e:
            build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="x", default_chat_template_kwargs=bad)
        assert "\n" not in str(e.value)
    (tmp_path / "run.json").write_text(json.dumps({"vl_thinking": False}))
    assert run_chat_defaults(str(tmp_path)) == {"thinking": False}
    (tmp_path / "run.json").write_text(json.dumps({"vl_thinking": True}))
    assert run_chat_defaults(str(tmp_path)) == {} == run_chat_defaults(str(tmp_path / "none")) == run_chat_defaults(None)


# ---------------------------------------------------------------------- errors
def test_api_key(scripted):
    server, _ = scripted
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.list()
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200


BAD_BODIES = [
    b"{not json", b"", b"[]", b'"text"', b"null",
    {"model": "scripted"},  # no messages
    {"model": "scripted", "messages": []},
    {"model": "scripted", "messages": "hello"},
    {"model": "scripted", "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": "scripted", "messages": [{"role": "user"}]},
    {"model": "scripted", "messages": [{"role": "user", "content": 5}]},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "temperature": 7},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "n": 3},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 9},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},  # no tools
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
     "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"thinkin": False}},
    {"model": "scripted", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x",
                                                                           "content": "r"}]},
    {"model": "scripted", "messages": [{"role": "tool", "content": "x"}]},
    {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "scripted", "messages": [{"role": "user", "content": "x" * 5000}]},
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_chat_bodies_get_openai_4xx(scripted, body):
    server, _ = scripted
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}",
                                                                 "Content-Type": "application/json"}, **kw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_bad_completion_bodies(scripted):
    server, _ = scripted
    h = {"Authorization": f"Bearer {KEY}"}
    for body in ({"model": "scripted"}, {"model": "scripted", "prompt": ""}, {"model": "scripted", "prompt": [10**9]},
                 {"model": "scripted", "prompt": "hi", "max_tokens": 0}, {"model": "scripted", "prompt": ["a", "b"]},
                 {"model": "scripted", "prompt": "hi", "logprobs": 9}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=h)
        assert r.status_code == 400, (body, r.text)
    assert httpx.get(server.url + "/v1/nothing", headers=h).status_code == 404


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)
FIELDS = ["model", "messages", "max_tokens", "temperature", "top_p", "stop", "stream", "seed", "tools",
          "tool_choice", "logprobs", "top_logprobs", "n", "reasoning_effort", "stream_options", "prompt"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), field=st.sampled_from(FIELDS),
       value=json_values)
def test_fuzzed_fields_never_5xx(scripted, path, field, value):
    server, _ = scripted
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 3}
    body[field] = value
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_client_disconnect_cancels_and_frees_pages(tiny):
    server, engine = tiny
    body = {"model": "k3-tiny", "prompt": "The quick brown fox", "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one token arrived; hang up
    wait_idle(engine)
    assert engine.cache.pool.num_used == 0
    # non-streaming: the request is aborted when the client times out and disconnects
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    wait_idle(engine)


def test_k3_serve_cli_end_to_end(tmp_path, tokenizer):
    """`k3 serve --run DIR` as a real process, on a run folder laid out like `k3 train` writes it."""
    import socket
    import subprocess
    import sys

    from k3.checkpoint.official import save_pretrained
    from k3.text.tokenizer import save_tokenizer

    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=tokenizer.get_vocab_size()))
    step = tmp_path / "run" / "checkpoints" / "step_0000007"
    save_pretrained(model, step)
    save_tokenizer(tokenizer, step)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "k3", "serve", "--run", str(tmp_path / "run"), "--port", str(port),
                             "--api-key", KEY, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "k3 serve did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["run"]
        out = c.chat.completions.create(model="run", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert out.usage.completion_tokens <= 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------- failures
@pytest.fixture
def flaky(tokenizer):
    """The scripted model behind a server whose forward raises while `fail["n"]` > 0 (or forever at -1)."""
    model = scripted_chat_model(tokenizer, REPLY)
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=2048, max_num_seqs=8))
    fail = {"n": 0}
    execute = engine.runner.execute

    def flaky_execute(out, params):
        if fail["n"] and out.requests:
            fail["n"] -= fail["n"] > 0
            raise RuntimeError("boom")
        return execute(out, params)

    engine.runner.execute = flaky_execute
    async_engine = AsyncEngine(engine, tokenizer)
    with ServerThread(build_app(async_engine, tokenizer, model_name="scripted")) as server:
        yield server, engine, async_engine, fail


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_failed_step_fails_its_requests_only_then_503_when_broken(flaky):
    server, engine, async_engine, fail = flaky
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    url = server.url + "/v1/chat/completions"
    fail["n"] = 1
    assert _openai_error(httpx.post(url, json=body, timeout=60), 500)["type"] == "server_error"
    wait_idle(engine)
    assert engine.cache.pool.num_used == 0 and async_engine.error is None and not async_engine._queues
    assert httpx.post(url, json=body, timeout=60).status_code == 200  # the loop kept running
    fail["n"] = 1  # streaming: the status line is out, so the error comes as an SSE event, then [DONE]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-2][6:])["error"]["type"] == "server_error" and lines[-1] == "data: [DONE]"
    wait_idle(engine)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.post(url, json=body, timeout=60).status_code == 200  # a good step resets the failure count
    fail["n"] = -1  # a broken model: after a few failed steps in a row the engine stops
    for _ in range(AsyncEngine.max_consecutive_step_failures):
        _openai_error(httpx.post(url, json=body, timeout=60), 500)
    assert async_engine.error is not None
    assert _openai_error(httpx.post(url, json=body, timeout=60), 503)["code"] == "engine_unavailable"
    assert httpx.get(server.url + "/health").status_code == 503
    assert engine.cache.pool.num_used == 0


def test_stream_abandoned_before_its_body_runs_is_aborted(tokenizer):
    """The client is gone before the SSE generator is first iterated: the request is still aborted."""
    import asyncio
    import contextlib

    model = ScriptedModel(tokenizer.get_vocab_size(), 0, [5] * 8, 6)
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=512))
    async_engine = AsyncEngine(engine, tokenizer)  # not started: nothing steps behind our back
    app = build_app(async_engine, tokenizer, model_name="m")
    body = json.dumps({"model": "m", "prompt": "The quick brown fox", "max_tokens": 300, "stream": True,
                       "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"t")], "scheme": "http",
             "server": ("t", 80), "client": ("c", 1)}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        raise OSError("client gone")

    async def main():
        with contextlib.suppress(Exception):  # the app may raise at the vanished client: what it frees is checked
            await app(scope, receive, send)

    asyncio.run(main())
    assert not async_engine._queues and len(engine._aborts) == 1
    while engine.has_unfinished:
        engine.step()
    assert engine.cache.pool.num_used == 0 and not engine.scheduler.requests


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_cli_bad_model_is_one_line_exit_2(tmp_path, capsys, command):
    import argparse
    import importlib

    mod = importlib.import_module("k3.serve.cli" if command == "serve" else "k3.serve.chat_cli")
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    for argv in (["--model", str(tmp_path / "nope")], ["--run", str(tmp_path)]):
        assert mod.run(p.parse_args(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"k3 {command}: error: ") and "\n" not in err, err


def test_cli_bad_default_chat_template_kwargs_fail_before_loading(tmp_path, capsys):
    import argparse

    from k3.serve import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--model", str(tmp_path / "nope"), "--default-chat-template-kwargs", '{"thinking": "maybe"}'])
    assert cli.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3 serve: error: default chat template kwargs: thinking") and "\n" not in err, err
    with pytest.raises(SystemExit):  # not a JSON object: argparse's usage error
        p.parse_args(["--model", "m", "--default-chat-template-kwargs", "[1]"])


def test_chat_template_kwargs_take_the_official_thinking_effort(scripted):
    """chat_template_kwargs.thinking_effort (the official encoder's keyword) renders what the same
    reasoning_effort renders; both given, they must agree (400 naming reasoning_effort)."""
    server, engine = scripted
    c = client(server, KEY)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def prompt_tokens(**extra):
        r = c.chat.completions.create(model="scripted", messages=messages, temperature=0, max_tokens=1, **extra)
        return r.usage.prompt_tokens

    low = prompt_tokens(extra_body={"chat_template_kwargs": {"thinking_effort": "low"}})
    assert low == prompt_tokens(reasoning_effort="low") != prompt_tokens()
    assert low == prompt_tokens(reasoning_effort="minimal", extra_body={"chat_template_kwargs": {"thinking_effort": "low"}})
    for bad in ({"reasoning_effort": "high", "chat_template_kwargs": {"thinking_effort": "low"}},
                {"chat_template_kwargs": {"thinking_effort": "medium"}}):
        r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "scripted", "messages": messages, "max_tokens": 1, **bad})
        assert r.status_code == 400, r.text
    assert "disagree" in r.text or "thinking_effort" in r.text
    wait_idle(engine)
