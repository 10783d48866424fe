"""The server against a hostile client: no request parameter can fail a batch-mate or
stop the engine, stop strings and bodies are bounded (400 / 413, the key checked before the body is
read), tokenization leaves the event loop free, odd input is a 400 (lone surrogates, deep nesting,
bools as ints, invalid tool schemas), 405 keeps `Allow`, the OpenAPI schema promises 400 (not
422), and /metrics counts every finished request by reason, cancelled and failed ones included."""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.serve.sampling import MAX_STOP_CHARS, SamplingParams
from k3.text.tokenizer import train_tokenizer
from tests.serve.fakes import PoisonModel, one_torch_thread, scripted_chat_model  # noqa: F401 (autouse fixture)

KEY = "hostile-key"
SMALL_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["The quick brown fox jumps over the lazy dog.", "hello there, general"] * 4, 320)


def scripted_engine(tokenizer) -> LLMEngine:
    model = scripted_chat_model(tokenizer, "Hello there.")
    return LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=2048, max_num_seqs=8))


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = scripted_engine(tokenizer)
    async_engine = AsyncEngine(engine, tokenizer)
    with ServerThread(build_app(async_engine, tokenizer, model_name="m")) as s:
        yield s, engine, async_engine


@pytest.fixture(scope="module")
def keyed(tokenizer):
    """Behind an API key, with a small body limit."""
    app = build_app(AsyncEngine(scripted_engine(tokenizer), tokenizer), tokenizer, model_name="m", api_key=KEY,
                    max_request_bytes=SMALL_LIMIT)
    with ServerThread(app) as s:
        yield s


def post(server, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # escapes lone surrogates as \ud800
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def wait_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.scheduler.requests or engine.cache.pool.num_used:
        assert time.monotonic() < deadline, "requests or pages still held"
        time.sleep(0.05)


def metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{want}}} (\S+)$" if labels else rf"^{name} (\S+)$", text, flags=re.MULTILINE)
    return float(m.group(1)) if m else 0.0


class Stream(threading.Thread):
    """A streaming completion read to its end in the background: the healthy batch-mate."""

    def __init__(self, server, body: dict):
        super().__init__(daemon=True)
        self.server, self.body, self.lines = server, body, []

    def run(self):
        with httpx.stream("POST", self.server.url + "/v1/completions", json=self.body, timeout=60) as r:
            self.lines = [line for line in r.iter_lines() if line.startswith("data: ")]

    def result(self) -> dict:
        self.join(60)
        assert self.lines and self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return json.loads(self.lines[-2][6:])


HEALTHY = {"model": "m", "prompt": "The quick brown fox", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
           "stream": True, "stream_options": {"include_usage": True}}


# ---------------------------------------------------------------------- item 1: sampling
@pytest.mark.parametrize("sampling", [{"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 7e-46},
                                      {"temperature": 2.0, "top_p": 5e-324, "top_k": 3}], ids=str)
def test_extreme_sampling_values_never_fail_or_stop_the_engine(server, sampling):
    """These made multinomial raise inside the step: the step failed its batch-mates, and three of
    them stopped the engine for good (every call a 503)."""
    s, engine, async_engine = server
    mate = Stream(s, HEALTHY)
    mate.start()
    for _ in range(AsyncEngine.max_consecutive_step_failures + 1):
        r = post(s, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, **sampling})
        assert r.status_code == 200, r.text
        chat = post(s, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 40, **sampling})
        assert chat.status_code == 200, chat.text
        content = chat.json()["choices"][0]["message"]["content"]
        # the scripted reply after its (empty) think channel, greedy as it must be
        assert content and "Hello there.".startswith(content), chat.json()
    assert mate.result()["usage"]["completion_tokens"] == HEALTHY["max_tokens"]
    assert httpx.get(s.url + "/health").status_code == 200 and async_engine.error is None
    wait_idle(engine)


@pytest.fixture
def poisoned(tokenizer):
    """PoisonModel behind a server: any request whose tokens hold `poison` gets NaN logits."""
    vocab = tokenizer.get_vocab_size()
    model = PoisonModel(vocab, poison=vocab - 1)
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=512, max_num_seqs=8))
    async_engine = AsyncEngine(engine, tokenizer)
    with ServerThread(build_app(async_engine, tokenizer, model_name="m")) as s:
        yield s, engine, async_engine, model.poison


def test_engine_step_isolates_a_request_whose_sampling_fails(tokenizer):
    vocab = tokenizer.get_vocab_size()
    engine = LLMEngine(PoisonModel(vocab, poison=vocab - 1), EngineConfig(block_size=16, max_model_len=512))
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    bad = engine.add_request([5, vocab - 1], SamplingParams(max_tokens=6, temperature=0.8))
    ended = {}
    while engine.has_unfinished:
        ended.update({o.request_id: o for o in engine.step() if o.finished})  # a StepError would raise here
    assert ended[bad.request_id].finish_reason == "error" and "sampling failed" in ended[bad.request_id].error
    assert ended[good.request_id].finish_reason == "length" and len(good.output_token_ids) == 6
    assert engine.cache.pool.num_used == 0


def test_a_failing_request_fails_alone_and_is_counted(poisoned):
    s, engine, async_engine, poison = poisoned
    mate = Stream(s, {**HEALTHY, "prompt": [5, 6, 7]})
    mate.start()
    bad = {"model": "m", "prompt": [5, poison], "max_tokens": 4, "temperature": 1.0}
    for _ in range(AsyncEngine.max_consecutive_step_failures + 1):
        assert error_of(post(s, "/v1/completions", bad), 500)["code"] == "engine_error"
    with httpx.stream("POST", s.url + "/v1/completions", json={**bad, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-2][6:])["error"]["code"] == "engine_error" and lines[-1] == "data: [DONE]"
    assert mate.result()["usage"]["completion_tokens"] == HEALTHY["max_tokens"]
    assert httpx.get(s.url + "/health").status_code == 200 and async_engine.error is None
    wait_idle(engine)
    assert metric(s, "k3_requests_total", finish_reason="error") == AsyncEngine.max_consecutive_step_failures + 2
    assert metric(s, "k3_requests_total", finish_reason="length") == 1


def test_cancelled_requests_are_counted(server):
    s, engine, _ = server
    before = metric(s, "k3_requests_total", finish_reason="cancelled")
    with httpx.stream("POST", s.url + "/v1/completions", json={**HEALTHY, "max_tokens": 400}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # hang up after the first chunk
    wait_idle(engine)
    deadline = time.monotonic() + 10
    while metric(s, "k3_requests_total", finish_reason="cancelled") < before + 1:
        assert time.monotonic() < deadline, "the cancelled request was not counted"
        time.sleep(0.05)


# ---------------------------------------------------------------------- item 2: stop strings
def test_stop_strings_are_bounded(server):
    s, _, _ = server
    base = {"model": "m", "prompt": "hi", "max_tokens": 2}
    for stop in (["a"] * 5, "x" * (MAX_STOP_CHARS + 1), ["ok", "y" * (1 << 20)]):
        t0 = time.monotonic()
        error_of(post(s, "/v1/completions", {**base, "stop": stop}), 400)
        assert time.monotonic() - t0 < 10
    assert post(s, "/v1/completions", {**base, "stop": ["z" * MAX_STOP_CHARS] * 4}).status_code == 200
    assert httpx.get(s.url + "/health").status_code == 200


# ---------------------------------------------------------------------- item 3: request size
def raw_request(server, head: str, body_parts: list[bytes] = ()) -> tuple[int, dict, bytes]:
    """Send a request by hand (headers, then body parts); -> (status, headers, body) of the reply."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode())
        try:
            for part in body_parts:
                sock.sendall(part)
        except OSError:  # the server answered and closed before the rest was sent
            pass
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"content-length: (\d+)", data.partition(b"\r\n\r\n")[0], re.IGNORECASE).group(1)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_body_over_the_limit_is_413_from_content_length_before_reading(keyed):
    head = ("POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            "Authorization: Bearer {key}\r\nContent-Length: 1000000000\r\n\r\n")
    status, _, body = raw_request(keyed, head.format(key=KEY))  # no body is ever sent: the reply may not wait
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    status, _, body = raw_request(keyed, head.format(key="wrong"))  # the key first, before any body
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_chunked_body_over_the_limit_is_413(keyed):
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 16384
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (SMALL_LIMIT // len(chunk) + 2) + [b"0\r\n\r\n"]
    status, _, body = raw_request(keyed, head, parts)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # under the limit, the same route works
    ok = httpx.post(keyed.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                    json={**CHAT, "user": "x" * (SMALL_LIMIT - 1000)})
    assert ok.status_code == 200, ok.text


def test_health_answers_while_a_big_prompt_tokenizes(server):
    s, _, _ = server
    prompt = "The quick brown fox jumps over the lazy dog, " * 60000  # 2.7 MB: seconds of tokenization
    result = {}

    def big():
        result["r"] = post(s, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1})

    worker = threading.Thread(target=big)
    worker.start()
    time.sleep(0.3)  # the body is in; tokenization has begun
    waits = []
    while worker.is_alive() and len(waits) < 20:
        t0 = time.monotonic()
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.05)
    worker.join(60)
    error = error_of(result["r"], 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert waits and max(waits) < 1.0, waits


# ---------------------------------------------------------------------- item 4 and 5: odd input
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP_ARGS = "[" * 100000 + "]" * 100000


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def call(arguments: str) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


BAD = [
    ("/v1/completions", {"model": "m", "prompt": "\ud800"}),
    ("/v1/completions", {"model": "m", "prompt": ["a\udfffb"]}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stop": ["\ud800"]}),
    ("/v1/completions", {"model": "m", "prompt": [[False]]}),
    ("/v1/completions", {"model": "m", "prompt": [True, 5]}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": True}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2.5}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": "2"}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "temperature": "0.5"}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": True}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stream": 1}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}, call(DEEP_ARGS)]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}, call('{"a": "\ud800"}')]}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f",
                                                                                 "parameters": nested(200)}}]}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"\ud800": {"type": "string"}}}}}]}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f",
                                                                                 "parameters": {"type": "nope"}}}]}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f",
                                                                                 "parameters": {"properties": 5}}}]}),
    # schemas that compile only by reading the server's disk or network, or not at all: 400 before
    # generating, never a file read, a fetch, or a 500 after the reply
    *[("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": p}}]})
      for p in ({"$ref": "file:///etc/hostname"}, {"$ref": "http://127.0.0.1:9/s.json"},
                {"$id": "http://example.com/root", "properties": {"a": {"$ref": "other.json"}}},
                {"$ref": "#/definitions/missing"},
                {"type": "object", "properties": {"c": {"type": "string", "pattern": "(("}}})],
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": False}),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}),
]


@pytest.mark.parametrize("path,body", BAD, ids=range(len(BAD)))
def test_odd_input_is_400(server, path, body):
    """Lone surrogates were a TypeError (500) in the tokenizer, deep arguments a RecursionError (500);
    bools and floats passed as ints; invalid tool schemas were accepted."""
    s, _, _ = server
    error_of(post(s, path, body), 400)


def test_valid_neighbours_of_the_odd_input_pass(server):
    s, engine, _ = server
    ok = [("/v1/completions", {"model": "m", "prompt": "caf\u00e9 \U0001F600", "max_tokens": 2}),
          ("/v1/completions", {"model": "m", "prompt": [[5, 6]], "max_tokens": 2, "temperature": 1}),
          ("/v1/completions", {"model": "m", "prompt": [5.0, 6], "max_tokens": 2.0}),  # integers, to JSON Schema
          ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}, call('{"a": [[1]]}'),
                                                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
          ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
              "name": "f", "parameters": nested(10)}}]}),
          ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
              "type": "object", "$defs": {"s": {"type": "string"}}, "properties": {"c": {"$ref": "#/$defs/s"}}}}}]})]
    for path, body in ok:
        r = post(s, path, body)
        assert r.status_code == 200, (body, r.text)
    wait_idle(engine)


def test_405_keeps_its_allow_header(server):
    s, _, _ = server
    r = httpx.get(s.url + "/v1/completions")
    error_of(r, 405)
    assert r.headers["allow"] == "POST"


def test_openapi_promises_400_with_the_error_schema_and_no_422(server):
    s, _, _ = server
    schema = httpx.get(s.url + "/openapi.json").json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "401", "413", "429", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse"), (path, status)
    assert set(schema["components"]["schemas"]["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}


def test_an_oversized_body_sent_whole_gets_a_readable_413(keyed):
    """The client sends all of it before reading: the gate drains it first, so the connection is
    not reset under the client with the 413 unread."""
    too_big = b'{"prompt": "' + b"x" * (2 * SMALL_LIMIT) + b'"}'
    for _ in range(10):
        r = httpx.post(keyed.url + "/v1/completions", content=too_big, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
