"""A request with both Content-Length and Transfer-Encoding gets a prompt 400 in OpenAI's
error JSON, and the connection is closed: uvicorn's h11 read such a body as chunked, so a body sent
framed by its Content-Length held the connection open with no reply. Raw sockets on loopback, with
bounded timeouts."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine
from k3.text.tokenizer import train_tokenizer
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.serve.test_api_hostile import scripted_engine

KEY = "framing-key"
BODY = b'{"model": "m", "prompt": "hi", "max_tokens": 1}'
TIMEOUT = 10.0  # seconds: the reply is immediate; a hang fails here instead of holding the suite


@pytest.fixture(scope="module")
def server():
    tokenizer = train_tokenizer(["The quick brown fox jumps over the lazy dog.", "hello there, general"] * 4, 320)
    app = build_app(AsyncEngine(scripted_engine(tokenizer), tokenizer), tokenizer, model_name="m", api_key=KEY)
    with ServerThread(app) as s:
        yield s


def exchange(server, raw: bytes) -> tuple[bytes, float]:
    """Send `raw`, read until the server closes the connection; -> (reply, seconds to the close)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(raw)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            pytest.fail(f"no close within {TIMEOUT} s; got {data[:200]!r}")
    return data, time.monotonic() - t0


def head(path: str = "/v1/completions", key: str = KEY, length: int = len(BODY)) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Length: {length}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()


@pytest.mark.parametrize("body", [b"", BODY, b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)],
                         ids=["no-body", "length-framed", "chunked"])
@pytest.mark.parametrize("key", [KEY, "wrong"], ids=["key", "no-key"])
def test_content_length_with_transfer_encoding_is_a_prompt_400(server, body, key):
    reply, seconds = exchange(server, head(key=key) + body)
    status_line, _, rest = reply.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    assert status_line.split()[1] == b"400", reply[:300]
    assert b"connection: close" in headers.lower()
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "ambiguous_framing")
    assert seconds < TIMEOUT / 2


def test_one_framing_alone_still_works(server):
    r = httpx.post(server.url + "/v1/completions", content=BODY, timeout=60,
                   headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    chunked = head().replace(b"Content-Length: %d\r\n" % len(BODY), b"") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    reply, _ = exchange(server, chunked.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
