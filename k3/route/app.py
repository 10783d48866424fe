"""The router's FastAPI app: /v1/completions and /v1/chat/completions forwarded to a replica chosen
by the policy (docs/ROUTING.md), /v1/models from a live replica, its own /health and /metrics.

Bodies are forwarded byte for byte (a sampled stream without a seed gets one, so that it can be
resumed), replies as they come: a stream event by event, never buffered. A replica that refuses a
connection, answers 503, or drops a reply is marked down and the request goes to its next replica;
a stream cut in the middle is resumed there (k3/route/resume.py). The router's own refusals are
OpenAI-style error JSON: 400 bad JSON or session key, 401 key, 413 body size, 429 admission wait,
503 no replica.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.route.admission import Admission, AdmissionTimeout, Grant, ReplicaGone
from k3.route.affinity import PromptKeys, SessionKeyError, explicit_key
from k3.route.metrics import RouteMetrics
from k3.route.policy import Policy
from k3.route.replicas import ReplicaSet
from k3.route.resume import Diverged, Transcript
from k3.serve.api.errors import APIError
from k3.serve.api.gate import DEFAULT_MAX_REQUEST_BYTES, RequestGate

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-k3-replica"  # on every forwarded reply: which replica answered
PASSED_HEADERS = ("content-type", "retry-after")


@dataclass
class Router:
    replicas: ReplicaSet
    policy: Policy
    admission: Admission
    keys: PromptKeys
    client: httpx.AsyncClient
    replica_headers: dict = field(default_factory=dict)  # sent to every replica (its API key)
    health_interval: float = 1.0

    def __post_init__(self):
        self.metrics = RouteMetrics(self.replicas, self.admission)
        self.replicas.on_down = self.admission.drop
        self.admission.alive = lambda: len(self.replicas.alive())


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Trip:
    """One client request's way through the replicas: its order of preference, the admission grant
    and the open reply of the replica serving it now."""

    def __init__(self, router: Router, path: str, body: bytes, tokens: int, order: list[str]):
        self.router, self.path, self.body, self.tokens = router, path, body, tokens
        self.order = router.admission.order(router.admission.classify(tokens), order)
        self.tried: set[str] = set()
        self.held = AsyncExitStack()
        self.url: str | None = None
        self.grant: Grant | None = None
        self.waited = 0.0

    def fail(self, reason: str, why: str) -> None:
        """The current replica failed this request: down, and the request moves on."""
        self.router.replicas.mark_down(self.url, why)
        self.router.metrics.failovers.labels(reason).inc()

    async def release(self) -> None:
        held, self.held = self.held, AsyncExitStack()
        await held.aclose()

    def _no_replica(self) -> APIError:
        r = self.router.replicas
        down = "; ".join(f"{url} ({r[url].last_error or 'failed this request'})" for url in self.order)
        self.router.metrics.rejected.labels("503").inc()
        return APIError(503, f"no replica is available: {down}", type="server_error", code="no_replica",
                        headers={"Retry-After": "1"})

    async def open(self) -> httpx.Response:
        """The next replica's reply, status and headers read; APIError when no replica is left."""
        r = self.router
        while True:
            self.url = next((u for u in self.order if u not in self.tried and r.replicas[u].up), None)
            if self.url is None:
                raise self._no_replica()
            self.tried.add(self.url)
            held = AsyncExitStack()
            try:
                self.grant = await held.enter_async_context(r.admission.slot(self.url, self.tokens))
                self.waited += self.grant.waited
            except ReplicaGone:
                r.metrics.failovers.labels("waiting").inc()
                continue
            except AdmissionTimeout as e:
                r.metrics.rejected.labels("429").inc()
                raise APIError(429, f"router busy: {e}; retry later", type="rate_limit_error", code="admission_timeout",
                               headers={"Retry-After": "1"}) from None
            request = r.client.build_request("POST", self.url + self.path, content=self.body, headers=r.replica_headers)
            try:
                reply = await r.client.send(request, stream=True)
            except httpx.TransportError as e:
                await held.aclose()
                self.fail("connect", f"{type(e).__name__}: {e}")
                continue
            held.push_async_callback(reply.aclose)
            if reply.status_code == 503:  # its engine stopped
                await held.aclose()
                self.fail("unavailable", "answered 503")
                continue
            self.held = held
            r.metrics.responses.labels(self.url, str(reply.status_code)).inc()
            return reply


def _generated(data: str) -> bool:
    """An event that carries generated output (not a chat stream's opening role chunk, which comes
    before the prefill): the replica has the prompt's prefill done."""
    try:
        choices = json.loads(data).get("choices")
    except (ValueError, AttributeError):
        return True
    return not any(isinstance(c, dict) and "role" in (c.get("delta") or {}) for c in choices or ())


def _headers(reply: httpx.Response, url: str) -> dict:
    return {**{h: reply.headers[h] for h in PASSED_HEADERS if h in reply.headers}, REPLICA_HEADER: url}


async def _whole(trip: Trip) -> Response:
    """A reply read whole; a replica that drops it mid-way passes the request on."""
    while True:
        reply = await trip.open()
        try:
            content = await reply.aread()
        except httpx.TransportError as e:
            trip.fail("response", f"{type(e).__name__}: {e}")
            continue
        finally:
            await trip.release()
        return Response(content, status_code=reply.status_code, headers=_headers(reply, trip.url))


async def _stream(trip: Trip, cls: str, t0: float) -> Response:
    reply = await trip.open()
    if reply.status_code != 200:  # a refusal comes whole, with its status
        try:
            content = await reply.aread()
        finally:
            await trip.release()
        return Response(content, status_code=reply.status_code, headers=_headers(reply, trip.url))
    router, first_url = trip.router, trip.url

    async def events():
        nonlocal reply
        transcript, timed = Transcript(), False
        try:
            while True:
                try:
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: "):]
                        if trip.grant.prefilling and _generated(data):
                            trip.grant.prefilled()
                        if data == "[DONE]":
                            yield "data: [DONE]\n\n"
                            return
                        out = transcript.pass_on(data)
                        if out is None:
                            continue
                        if not timed and any(transcript.sent.values()):
                            timed = True
                            router.metrics.ttft.labels(cls).observe(time.monotonic() - t0)
                        yield f"data: {out}\n\n"
                    raise httpx.RemoteProtocolError("the stream ended without [DONE]")
                except httpx.TransportError as e:
                    trip.fail("stream", f"{type(e).__name__} mid-stream: {e}")
                    await trip.release()
                    reply = await trip.open()
                    if reply.status_code != 200:
                        raise APIError(502, f"the next replica answered {reply.status_code}", type="server_error") from None
                    transcript.restart()
                    router.metrics.stream_restarts.labels("resumed").inc()
        except (APIError, Diverged) as e:
            router.metrics.stream_restarts.labels("error").inc()
            yield _sse({"error": {"message": f"replica {first_url} failed mid-stream and the reply could not be "
                                             f"resumed: {e}", "type": "server_error", "param": None,
                                  "code": "replica_failed"}})
            yield "data: [DONE]\n\n"
        finally:
            await trip.release()

    return StreamingResponse(events(), media_type="text/event-stream", headers={REPLICA_HEADER: first_url})


async def forward(request: Request, path: str, *, chat: bool) -> Response:
    router: Router = request.app.state.router
    t0 = time.monotonic()
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:
        router.metrics.rejected.labels("400").inc()
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        router.metrics.rejected.labels("400").inc()
        raise APIError(400, "the body must be a JSON object")
    try:
        key = explicit_key(request.headers, body)
    except SessionKeyError as e:
        router.metrics.rejected.labels("400").inc()
        raise APIError(400, str(e), param=e.param, code="invalid_session_key") from None
    prompt_key, tokens = await asyncio.to_thread(router.keys.analyse, body, chat=chat)
    stream = body.get("stream") is True
    if stream and body.get("seed") is None and body.get("temperature") != 0:
        body["seed"] = random.getrandbits(63)  # a resumed stream samples what the first one did
        raw = json.dumps(body).encode()
    trip = Trip(router, path, raw, tokens, router.policy.preference(key or prompt_key))
    cls = router.admission.classify(tokens)
    try:
        if stream:
            return await _stream(trip, cls, t0)
        return await _whole(trip)
    finally:
        router.metrics.queued.labels(cls).observe(trip.waited)


def build_app(router: Router, *, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(router.replicas.watch(router.health_interval))
        yield
        watcher.cancel()
        await router.client.aclose()
        # here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once it has shut down
        await asyncio.to_thread(router.replicas.stop_spawned)

    app = FastAPI(title="k3 route", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # 404, 405
        return _error(APIError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug: still OpenAI's shape
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return _error(APIError(500, f"internal router error: {type(e).__name__}", type="server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        trip = Trip(router, "/v1/models", b"", 0, list(router.replicas.replicas))
        for url in router.replicas.alive():
            try:
                reply = await router.client.get(url + "/v1/models", headers=router.replica_headers)
            except httpx.TransportError as e:
                router.replicas.mark_down(url, f"{type(e).__name__}: {e}")
                continue
            return Response(reply.content, status_code=reply.status_code, headers=_headers(reply, url))
        raise trip._no_replica()

    @app.get("/health")
    async def health():
        state = {url: "up" if r.up else f"down: {r.last_error}" for url, r in router.replicas.replicas.items()}
        up = any(r.up for r in router.replicas.replicas.values())
        return JSONResponse({"status": "ok" if up else "no replica", "replicas": state}, status_code=200 if up else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(RequestGate, api_key=api_key, max_request_bytes=max_request_bytes)
    return app
