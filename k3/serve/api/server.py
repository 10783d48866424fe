"""The FastAPI app around an AsyncEngine, and running it with uvicorn (127.0.0.1 by default).

Every error leaves as OpenAI's JSON shape: validation failures and malformed JSON as 400 (never
FastAPI's 422 or a 5xx), a missing/wrong API key as 401 (checked before the body is read), a body
over the size limit as 413, a full queue as 429 with Retry-After. The published OpenAPI schema
says so: each operation lists its error statuses with the error schema, and no 422.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from k3.media.image_processor import ImageProcessor
from k3.serve.api.gate import DEFAULT_MAX_REQUEST_BYTES, RequestGate
from k3.serve.api.media_fetch import FetchPolicy
from k3.serve.api.metrics import Metrics
from k3.serve.api.protocol import APIError, ChatCompletionRequest, ChatTemplateKwargs, CompletionRequest
from k3.serve.api.routes import ServingContext, router
from k3.serve.engine import AsyncEngine
from k3.text.generation_config import GenerationDefaults
from k3.text.xtml import XTML

log = logging.getLogger(__name__)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def chat_template_defaults(kwargs: dict | None) -> ChatTemplateKwargs | None:
    """`--default-chat-template-kwargs` (vLLM's flag), checked as a request's would be; ValueError
    in one line for an unknown key or a wrong type."""
    if not kwargs:
        return None
    try:
        return ChatTemplateKwargs.model_validate(kwargs)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"default chat template kwargs: {problems}") from None


BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _exact_bounds(published, source) -> None:
    """Put pydantic's own numeric bounds back into FastAPI's copy of a schema, walking the two side
    by side: FastAPI's OpenAPI model stores every bound as a float, and 2**63 - 1 (the seed's
    maximum) comes out as 2**63, a seed the server refuses."""
    if isinstance(published, dict) and isinstance(source, dict):
        for key, value in source.items():
            if key in BOUND_KEYS and isinstance(value, (int, float)) and key in published:
                published[key] = value
            elif key in published:
                _exact_bounds(published[key], value)
    elif isinstance(published, list) and isinstance(source, list) and len(published) == len(source):
        for p, s in zip(published, source):
            _exact_bounds(p, s)


def _request_schemas() -> dict[str, dict]:
    """The request bodies' component schemas as pydantic writes them (exact bounds)."""
    out = {}
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}), **{model.__name__: schema})
    return out


def _field_path(body, loc) -> list:
    """A validation error's location in the request body: pydantic's union-branch tags ("str", a
    discriminator's value) dropped, keeping each step the body has (and a missing field's name)."""
    path, node = [], body
    steps = list(loc[1:]) if loc and loc[0] == "body" else list(loc)
    for i, step in enumerate(steps):
        if (isinstance(node, dict) and step in node) or (
                isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node)):
            node = node[step]
        elif not isinstance(node, (dict, list)):
            break  # the error is at this value (the model's steps past it are the value's expected shape)
        elif not (isinstance(node, dict) and i == len(steps) - 1):
            continue  # a union-branch tag: nothing in the body
        path.append(step)  # (a missing field of an object is named too)
    return path


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, *, model_name: str, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              default_chat_template_kwargs: dict | None = None, media_fetch: FetchPolicy | None = None,
              chat=None, generation: GenerationDefaults | None = None) -> FastAPI:
    """default_chat_template_kwargs: used by chat requests that send no chat_template_kwargs;
    media_fetch: the policy under which http(s) image URLs are fetched (None: they are refused);
    chat: the chat format (k3.text.model_folder.chat_format; default XTML over `tokenizer` when it
    has K3's markers); generation: the checkpoint's generation_config.json defaults."""
    chat_defaults = chat_template_defaults(default_chat_template_kwargs)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="k3", lifespan=lifespan)
    if chat is None:
        try:
            chat = XTML(tokenizer)
        except ValueError as e:  # e.g. a Kimi Linear base tokenizer without a chat template: completions only
            log.warning("chat endpoint disabled: %s", e)
    vision = engine.engine.vision
    images = None if vision is None else ImageProcessor.from_vision_config(vision.config.vision_config)
    app.state.ctx = ServingContext(engine, tokenizer, chat, model_name, Metrics(engine.engine), int(time.time()),
                                   images, chat_defaults, media_fetch, generation or GenerationDefaults())

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        # the deepest error names the field at fault (a union's first branch, "str", does not)
        located = [(_field_path(getattr(e, "body", None), err.get("loc", ())), err) for err in errors]
        path, first = max(located, key=lambda pe: len(pe[0])) if located else ([], {"msg": "invalid request"})
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in path).lstrip(".")
        message = f"{where + ': ' if where else ''}{first.get('msg')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more errors)"
        return _error(APIError(400, message, param=where or None,
                               code="invalid_json" if first.get("type") == "json_invalid" else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # 404, 405 (keeps its Allow header)
        return _error(APIError(e.status_code, str(e.detail), type="invalid_request_error", headers=e.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug: still OpenAI's shape
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return _error(APIError(500, f"internal server error: {type(e).__name__}", type="server_error"))

    app.include_router(router)
    app.add_middleware(RequestGate, api_key=api_key, max_request_bytes=max_request_bytes)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema["paths"].values():  # FastAPI adds a 422 we never send (it is a 400)
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for name, source in _request_schemas().items():
                if name in components:
                    _exact_bounds(components[name], source)
            for name in ("CompletionRequest", "ChatCompletionRequest"):  # the one model served (else 404)
                components[name]["properties"]["model"]["enum"] = [model_name]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable from other machines", host)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


class ServerThread:
    """Uvicorn in a background thread on a free loopback port (tests, benchmarks, `k3 chat`)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                                    backlog=1024))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:  # noqa: PYI034 (typing.Self is Python 3.11+)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
