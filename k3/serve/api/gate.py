"""The gate every HTTP request passes before the app sees it: the framing, the API key, then the
body size.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which wraps `receive` so that a
handler can no longer see the client disconnect). The key is checked from the headers before
any byte of the body is read, and the body is refused with 413 from its Content-Length or, for a
chunked body, as soon as what has arrived passes the limit: a hostile client cannot make the
server buffer or parse more than `max_request_bytes`. The rest of an oversized body, up to 4x the
limit, is read and dropped before the 413 goes out, so the client can read it (a socket closed
with unread bytes is reset, and the reset can discard the response). A request with both Content-Length and
Transfer-Encoding is a 400 at once (RFC 9112 §6.1 lets a server reject it, and says to close the
connection after): uvicorn's h11 reads such a body as chunked, so a client that sent it framed by
its Content-Length was held open, waiting for chunks that never came (and the two framings are
how requests are smuggled past a proxy that reads the other one).
"""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from k3.serve.api.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # far above any prompt that fits a model length, far below memory
# readable without the API key: probes, scrapers and the published schema
OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


def _ambiguous_framing() -> APIError:
    return APIError(400, "a request may have Content-Length or Transfer-Encoding, not both", code="ambiguous_framing")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than {limit} bytes (the server's --max-request-bytes)",
                    code="request_too_large")


class RequestGate:
    def __init__(self, app, *, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.app, self.api_key, self.limit = app, api_key, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # lower-case names as bytes (ASGI)
        if b"content-length" in headers and b"transfer-encoding" in headers:
            return await _reply(_ambiguous_framing(), scope, receive, send)
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return await _reply(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                             type="authentication_error", code="invalid_api_key"), scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse_large(int(length), scope, receive, send)
        chunks, size = [], 0
        while True:  # read the whole body here, bounded, before the app parses anything
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse_large(None, scope, receive, send, more=message.get("more_body", False))
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect, as the app expects

        await self.app(scope, replay, send)


    async def _refuse_large(self, length: int | None, scope, receive, send, more: bool = True) -> None:
        """413, after reading and dropping the rest of a body of at most `drain_bytes` (nothing is
        kept): closing a socket with unread bytes makes the kernel reset it, and a client still
        sending loses the 413 it had not read yet. A longer body is refused at once."""
        drain_bytes = max(4 * self.limit, 1 << 20)
        if length is None or length <= drain_bytes:
            drained = 0
            while more and drained <= drain_bytes:
                message = await receive()
                if message["type"] != "http.request":  # the client left
                    return
                drained += len(message.get("body", b""))
                more = message.get("more_body", False)
        await _reply(_too_large(self.limit), scope, receive, send)


async def _reply(e: APIError, scope, receive, send) -> None:
    # close the connection: the unread body must not be taken for the next request
    headers = {**(e.headers or {}), "Connection": "close"}
    await JSONResponse(e.body(), status_code=e.status, headers=headers)(scope, receive, send)
