"""Stand-in replicas for the router tests: a FastAPI app that lists a k3 model and answers chat and
completion requests with a fixed text, whole or streamed character by character, and can be told to
drop a stream midway or to stop being healthy. No model loads, so each test takes milliseconds."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from k3.route.admission import Admission, Budgets
from k3.route.affinity import PromptKeys
from k3.route.app import Router, build_app
from k3.route.policy import Policy
from k3.route.replicas import ReplicaSet
from k3.serve.api.server import ServerThread


@dataclass
class Behaviour:
    text: str = "hello world"
    die_after: int | None = None  # stream: characters sent before the connection drops
    healthy: bool = True
    k3: bool = True  # False: /v1/models is some other server's
    delay: float = 0.0  # seconds before each streamed character
    requests: int = 0


def fake_replica(b: Behaviour) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        if not b.k3:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"object": "list", "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "k3"}]}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok" if b.healthy else "error"}, status_code=200 if b.healthy else 503)

    async def generate(request: Request, chat: bool):
        body = await request.json()
        b.requests += 1
        if not body.get("stream") and b.die_after is None:  # (a dying replica drops whole replies too)
            choice = {"message": {"role": "assistant", "content": b.text}} if chat else {"text": b.text}
            return {"id": "x", "choices": [{"index": 0, **choice, "finish_reason": "stop"}]}
        rid = f"id-{b.requests}"

        def event(piece: str | None, finish: str | None = None) -> str:
            part = ({"delta": {} if piece is None else {"content": piece}} if chat else {"text": piece or ""})
            return f"data: {json.dumps({'id': rid, 'created': b.requests, 'choices': [{'index': 0, **part, 'logprobs': None, 'finish_reason': finish}]})}\n\n"

        async def events():
            if chat:
                yield f"data: {json.dumps({'id': rid, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}\n\n"
            for i, ch in enumerate(b.text):
                if b.die_after is not None and i == b.die_after:
                    raise ConnectionAbortedError("replica died")  # uvicorn drops the connection mid-body
                await asyncio.sleep(b.delay)
                yield event(ch)
            yield event(None, "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, False)

    return app


class Fleet(ExitStack):
    """n fake replicas and a router in front of them (all on loopback threads)."""

    def __init__(self, n: int = 3, budgets: Budgets | None = None, **router_kw):
        super().__init__()
        self.behaviours = [Behaviour() for _ in range(n)]
        self.servers = [self.enter_context(ServerThread(fake_replica(b))) for b in self.behaviours]
        self.urls = [s.url for s in self.servers]
        replicas = ReplicaSet(self.urls, httpx.AsyncClient())
        self.router = Router(replicas, Policy("affinity", self.urls), Admission(budgets or Budgets()), PromptKeys(None, 4),
                             replicas.client, health_interval=0.05)
        self.app = build_app(self.router, **router_kw)
        self.url = self.enter_context(ServerThread(self.app)).url
        deadline = time.monotonic() + 10
        while len(replicas.alive()) < n:
            assert time.monotonic() < deadline, "fake replicas never came up"
            time.sleep(0.02)

    def reset(self) -> None:
        """Every replica healthy and well behaved again, and up at the router."""
        for b in self.behaviours:
            b.__init__()
        deadline = time.monotonic() + 5
        while len(self.router.replicas.alive()) < len(self.urls):
            assert time.monotonic() < deadline, "fake replicas did not come back"
            time.sleep(0.01)

    def behaviour(self, url: str) -> Behaviour:
        return self.behaviours[self.urls.index(url)]
