"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions, /health,
/metrics. Requests become token ids + SamplingParams, go through the AsyncEngine, and come back
as OpenAI JSON or SSE chunks (`data: {...}`, then `data: [DONE]`). Prompts are tokenized on a worker
thread (with the GIL released), so a long prompt never holds up the event loop."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tokenizers import Tokenizer

from k3.media.image_processor import ImageProcessor
from k3.serve.api.chat_reply import ChatReply
from k3.serve.api.media import prepare_media
from k3.serve.api.media_fetch import FetchPolicy
from k3.serve.api.metrics import Metrics
from k3.serve.api.protocol import APIError, ChatCompletionRequest, ChatTemplateKwargs, CompletionRequest, ErrorResponse
from k3.serve.api.responses import ChatCompletion, Completion, Health, ModelList, ok
from k3.serve.api.tool_calls import ToolCallChecker
from k3.serve.engine import AsyncEngine, EngineError, ImageInput, RequestStream, StreamDelta
from k3.serve.request import ContextLengthError, fit_model_length
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import QueueFullError
from k3.text.generation_config import GenerationDefaults
from k3.text.template_chat import TemplateChat
from k3.text.tokenizer import encode_text
from k3.text.xtml import XTML, Rendered


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    chat: XTML | TemplateChat | None  # None: no chat format (no K3 markers, no chat template): completions only
    model_name: str
    metrics: Metrics
    created: int
    images: ImageProcessor | None = None  # a vision model's processor; None: text only
    chat_defaults: ChatTemplateKwargs | None = None  # --default-chat-template-kwargs, or the run's (run.json)
    media_fetch: FetchPolicy | None = None  # http(s) image URLs are fetched under it; None: never
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # generation_config.json's


router = APIRouter()


def _errors(*statuses: int) -> dict:
    """OpenAPI `responses` for these error statuses, all with the error schema."""
    why = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
           413: "request body over --max-request-bytes", 429: "queue full (see Retry-After)",
           500: "the model failed while serving the request", 503: "the engine has stopped"}
    return {s: {"model": ErrorResponse, "description": why[s]} for s in statuses}


GENERATE_ERRORS = _errors(400, 401, 404, 413, 429, 500, 503)


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


# ---------------------------------------------------------------------- plumbing
def _sampling(ctx: ServingContext, body, prompt_len: int, max_new: int | None, logprobs: int | None,
              stop_token_ids: list[int], prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        max_tokens = fit_model_length(prompt_len, max_new, ctx.engine.max_model_len)
    except ContextLengthError as e:
        prompt = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise APIError(400, str(e), code="context_length_exceeded",
                       param=prompt if e.prompt_fills else "max_tokens") from None
    g = ctx.generation  # the checkpoint's generation_config.json fills what the request leaves out
    temperature = body.temperature if body.temperature is not None else g.temperature
    top_p = body.top_p if body.top_p is not None else g.top_p
    top_k = body.top_k if "top_k" in body.model_fields_set or g.top_k is None else g.top_k
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
                              top_p=1.0 if top_p is None else top_p, top_k=top_k, seed=body.seed,
                              stop=body.stop_list, stop_token_ids=[*stop_token_ids, *g.eos_token_ids],
                              ignore_eos=body.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _submit(ctx: ServingContext, prompt_ids: list[int], params: SamplingParams, rid: str, **kw) -> RequestStream:
    def finished(reason: str) -> None:  # every admitted request, cancelled and failed ones included
        ctx.metrics.requests.labels(reason).inc()

    try:
        return ctx.engine.generate(prompt_ids, params, request_id=rid, on_finish=finished, **kw)
    except EngineError as e:
        ctx.metrics.rejected.labels("503").inc()
        raise APIError(503, f"the engine is unavailable: {e}", type="server_error", code="engine_unavailable") from None
    except QueueFullError as e:
        ctx.metrics.rejected.labels("429").inc()
        raise APIError(429, f"server busy: {e}; retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def _timed(ctx: ServingContext, stream: AsyncIterator[StreamDelta], t0: float) -> AsyncIterator[StreamDelta]:
    """Observe TTFT / inter-token latency and token counts as the client sees them."""
    m, last = ctx.metrics, None
    async with aclosing(stream) as deltas:
        async for d in deltas:
            if d.token_ids:
                now = time.monotonic()
                (m.ttft if last is None else m.itl).observe(now - (t0 if last is None else last))
                last = now
                m.generation_tokens.inc(len(d.token_ids))
            if d.finished:
                m.prompt_tokens.inc(d.num_prompt_tokens)
            yield d


def _engine_error(e: EngineError) -> APIError:
    return APIError(500, str(e), type="server_error", code="engine_error")


class _EngineStreamingResponse(StreamingResponse):
    """Closes (aborts, unless finished) the engine request however the response ends, even when
    the client is gone before the body generator first runs (then its `finally` never would)."""

    def __init__(self, content, handle: RequestStream, **kw):
        super().__init__(content, **kw)
        self.handle = handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.close()


def _streaming(sse: AsyncIterator[str], handle: RequestStream) -> StreamingResponse:
    return _EngineStreamingResponse(sse, handle, media_type="text/event-stream")


def _sse_error(e: EngineError) -> str:
    return _sse(_engine_error(e).body())


async def _collect(stream: AsyncIterator[StreamDelta], http: Request, handle: RequestStream) -> list[StreamDelta]:
    """Consume a whole stream, aborting it if the client goes away meanwhile."""
    try:
        return await _consume(stream, http)
    except EngineError as e:
        raise _engine_error(e) from None
    finally:
        handle.close()


async def _consume(stream: AsyncIterator[StreamDelta], http: Request) -> list[StreamDelta]:
    async def consume():
        async with aclosing(stream) as deltas:
            return [d async for d in deltas]

    task = asyncio.ensure_future(consume())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await http.is_disconnected():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            raise APIError(499, "client disconnected", code="client_closed_request")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(d: StreamDelta) -> dict:
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
            "total_tokens": d.num_prompt_tokens + d.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(chat: XTML, deltas: list[StreamDelta]) -> dict | None:
    """OpenAI's `logprobs.content`. `bytes` are each token's own bytes (a token holding part of a
    character decodes to U+FFFD as text, but the bytes joined give the reply back); the chat
    markers, which stand for no bytes, give their text's."""
    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(chat.tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(chat.token_bytes[token_id] or text.encode())}

    entries = []
    for d in deltas:
        for t in d.tokens:
            if t.logprob is None:
                return None
            top = [entry(i, lp) for i, lp in t.top_logprobs or ()]
            entries.append({**entry(t.token_id, t.logprob), "top_logprobs": top})
    return {"content": entries}


def _top_dict(tok: Tokenizer, top: list[tuple[int, float]] | None) -> dict[str, float]:
    """The legacy top_logprobs dict, text -> logprob. Ids that decode to the same text (byte pieces
    of one character) keep the best one's logprob, so its maximum stays the top token's."""
    out: dict[str, float] = {}
    for i, lp in top or ():
        out.setdefault(_token_text(tok, i), lp)
    return out


def _completion_logprobs(tok: Tokenizer, deltas: list[StreamDelta], offset: int) -> dict | None:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for d in deltas:
        for t in d.tokens:
            if t.logprob is None:
                return None
            s = _token_text(tok, t.token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append(_top_dict(tok, t.top_logprobs))
            out["text_offset"].append(offset)
            offset += len(s)
    return out


def _echo(tok: Tokenizer, ids: list[int], text: str, scored: list | None, top: int | None) -> tuple[str, dict | None]:
    """The echoed prompt of a completion and, with logprobs (`top` not None), its legacy logprobs
    object: each prompt token, its logprob (the first token's null: nothing precedes it) and its
    top alternatives, offsets into `text`."""
    if top is None:
        return text, None
    scored = scored or []  # none only when the request failed before scoring (its stream then raises)
    tokens = [_token_text(tok, i) for i in ids]
    offsets = [0]
    for s in tokens[:-1]:
        offsets.append(offsets[-1] + len(s))
    return text, {"tokens": tokens, "token_logprobs": [None] + [e.logprob for e in scored],
                  "top_logprobs": [None] + [_top_dict(tok, e.top_logprobs) for e in scored],
                  "text_offset": offsets}


def _joined(head: dict | None, tail: dict | None) -> dict | None:
    """Two legacy logprobs objects, one after the other (an echoed prompt's, then the completion's)."""
    if head is None or tail is None:
        return head or tail
    return {key: head[key] + tail[key] for key in head}


# ---------------------------------------------------------------------- endpoints
@router.get("/health", responses={**ok(Health, "the engine is running"), 503: {
    "description": "the engine has stopped", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"type": "string"}, "error": {"type": "string"}}}}}}})
async def health(request: Request):
    ctx = _ctx(request)
    if ctx.engine.error is not None:
        return JSONResponse({"status": "error", "error": repr(ctx.engine.error)}, status_code=503)
    return {"status": "ok"}


# Prometheus' text format: documented as text/plain, not FastAPI's default JSON
@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus metrics, in its text exposition format"}})
async def metrics(request: Request):
    return Response(generate_latest(_ctx(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", responses={**ok(ModelList, "the one model served"), **_errors(401)})
async def models(request: Request):
    ctx = _ctx(request)
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": ctx.created,
                                        "owned_by": "k3", "max_model_len": ctx.engine.max_model_len}]}


def _check_model(ctx: ServingContext, name: str) -> None:
    if name != ctx.model_name:
        raise APIError(404, f"model {name!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")


@router.post("/v1/completions", responses={**ok(Completion, "the completion", stream=True), **GENERATE_ERRORS})
async def completions(body: CompletionRequest, request: Request):
    ctx = _ctx(request)
    t0 = time.monotonic()
    _check_model(ctx, body.model)
    prompt = body.prompt
    ids = await asyncio.to_thread(encode_text, ctx.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, "the prompt encodes to no tokens", param="prompt")
    # echo with logprobs scores the prompt in the engine (vLLM's prompt_logprobs); max_tokens 0 scores only
    scoring = body.echo and (body.logprobs is not None or body.max_tokens == 0)
    params = _sampling(ctx, body, len(ids), body.max_tokens, body.logprobs, [],
                       prompt_logprobs=(body.logprobs or 0) if scoring else None)
    rid = f"cmpl-{uuid.uuid4().hex}"
    handle = _submit(ctx, ids, params, rid)
    stream = _timed(ctx, handle, t0)
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name}

    def echoed(d: StreamDelta) -> tuple[str, dict | None]:
        text = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(ids, skip_special_tokens=False)
        return _echo(ctx.tokenizer, ids, text, d.prompt_logprobs, body.logprobs)

    if not body.stream:
        deltas = await _collect(stream, request, handle)
        last = deltas[-1]
        head, head_lp = echoed(deltas[0]) if body.echo else ("", None)
        lp = _completion_logprobs(ctx.tokenizer, deltas, len(head)) if body.logprobs is not None else None
        choice = {"index": 0, "text": head + "".join(d.text for d in deltas), "finish_reason": last.finish_reason,
                  "logprobs": _joined(head_lp, lp)}
        return {**base, "choices": [choice], "usage": _usage(last)}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def sse():
        offset, first = 0, True
        try:
            async with aclosing(stream) as deltas:
                async for d in deltas:
                    head, head_lp = echoed(d) if body.echo and first else ("", None)
                    first = False
                    lp = (_completion_logprobs(ctx.tokenizer, [d], offset + len(head))
                          if body.logprobs is not None else None)
                    lp = _joined(head_lp, lp)
                    offset += len(head) + len(d.text)
                    chunk = {**base, "choices": [{"index": 0, "text": head + d.text, "logprobs": lp,
                                                  "finish_reason": d.finish_reason if d.finished else None}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
                    if d.finished and include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(d)})
        except EngineError as e:  # the status line is sent: the error goes in the stream
            yield _sse_error(e)
        yield "data: [DONE]\n\n"

    return _streaming(sse(), handle)


@dataclass
class _PreparedChat:
    """A chat request ready for the engine: its prompt, sampling, images, and the reply as the
    client will see it (parsed, stop strings on the content, tool calls checked)."""
    rendered: Rendered
    params: SamplingParams
    images: list[ImageInput]
    checker: ToolCallChecker
    reply: ChatReply

    def finish_reason(self, d: StreamDelta) -> str:
        return "tool_calls" if self.checker.calls and d.finish_reason == "stop" else d.finish_reason


async def _prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> _PreparedChat:
    """Validate a chat request, render its prompt (media decoded and the template applied off the
    event loop) and build its sampling parameters and reply: every 4xx is raised here, before the
    engine sees the request."""
    _check_model(ctx, body.model)
    if ctx.chat is None:
        raise APIError(400, "this model has no chat format (no K3 chat markers, no chat template); "
                            "use /v1/completions")
    tool_choice = body.tool_choice if not hasattr(body.tool_choice, "model_dump") else body.tool_choice.model_dump()
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    use_tools = bool(tools) and tool_choice != "none"
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        effort = body.effort(ctx.chat_defaults)
    except ValueError as e:
        raise APIError(400, str(e), param="reasoning_effort") from None
    try:
        media, images = None, []
        if ctx.images is not None:  # decoded off the event loop: a large image or a video takes a while
            prepared = await asyncio.to_thread(prepare_media, messages, ctx.images, ctx.media_fetch,
                                               ctx.engine.max_model_len)
            messages = prepared.messages  # video parts expanded into timestamped clips
            media = prepared.images.media(ctx.engine.media_placeholder_token_id)
        rendered = await asyncio.to_thread(
            ctx.chat.render, messages,
            tools=tools if use_tools else None, reasoning_effort=effort,
            thinking=body.thinking(ctx.chat_defaults),
            tool_choice=tool_choice if use_tools else None, media=media)
        if ctx.images is not None:
            images = prepared.images.engine_inputs(rendered.media_offsets)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling(ctx, body, len(rendered.token_ids), body.max_new_tokens, top, [ctx.chat.eos])
    # stop strings end the content the client sees (ChatReply), not the raw text with its tags
    checker = ToolCallChecker(tools, parallel=body.parallel_tool_calls is not False)
    reply = ChatReply(ctx.chat.parser_for(rendered), checker, params.stop)
    return _PreparedChat(rendered, params, images, checker, reply)


async def _chat_whole(ctx: ServingContext, body: ChatCompletionRequest, chat: _PreparedChat, base: dict,
                      stream: AsyncIterator[StreamDelta], http: Request, handle: RequestStream) -> dict:
    """The whole reply as one chat.completion object."""
    deltas = await _collect(stream, http, handle)
    reply, checker = chat.reply, chat.checker
    message = {"role": "assistant", "content": reply.content if reply.content or not checker.calls else None}
    if reply.reasoning:
        message["reasoning"] = message["reasoning_content"] = reply.reasoning
    if checker.calls:
        message["tool_calls"] = checker.calls
    if checker.errors:
        message["tool_call_errors"] = checker.errors
    choice = {"index": 0, "message": message, "finish_reason": chat.finish_reason(deltas[-1]),
              "logprobs": _chat_logprobs(ctx.chat, deltas) if body.logprobs else None}
    return {**base, "choices": [choice], "usage": _usage(deltas[-1])}


def _chat_stream(ctx: ServingContext, body: ChatCompletionRequest, chat: _PreparedChat, base: dict,
                 stream: AsyncIterator[StreamDelta], handle: RequestStream) -> StreamingResponse:
    """The reply as SSE chat.completion.chunk events: the role, then reasoning, content and tool
    calls as they are parsed, the finish reason, optionally the usage, then [DONE]."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {**base, "object": "chat.completion.chunk"}
    reply, checker = chat.reply, chat.checker

    def chunk(delta: dict, reason: str | None = None, logprobs=None) -> str:
        c = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
        if include_usage:
            c["usage"] = None
        return _sse(c)

    async def sse():
        try:
            async with aclosing(stream) as deltas:
                yield chunk({"role": "assistant", "content": ""})
                async for d in deltas:
                    lp = _chat_logprobs(ctx.chat, [d]) if body.logprobs else None
                    for kind, value in reply.take():
                        if kind == "tool_call":
                            yield chunk({"tool_calls": [value]})
                        elif kind == "reasoning":
                            yield chunk({"reasoning": value, "reasoning_content": value}, logprobs=lp)
                            lp = None
                        else:
                            yield chunk({"content": value}, logprobs=lp)
                            lp = None
                    if lp is not None and lp["content"]:
                        yield chunk({}, logprobs=lp)
                    if d.finished:
                        if checker.errors:
                            yield chunk({"tool_call_errors": checker.errors})
                        yield chunk({}, chat.finish_reason(d))
                        if include_usage:
                            yield _sse({**base, "choices": [], "usage": _usage(d)})
        except EngineError as e:  # the status line is sent: the error goes in the stream
            yield _sse_error(e)
        yield "data: [DONE]\n\n"

    return _streaming(sse(), handle)


@router.post("/v1/chat/completions",
             responses={**ok(ChatCompletion, "the chat completion", stream=True), **GENERATE_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = _ctx(request)
    t0 = time.monotonic()
    chat = await _prepare_chat(ctx, body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    handle = _submit(ctx, chat.rendered.token_ids, chat.params, rid, boundaries=chat.rendered.boundaries,
                     eos_token_id=ctx.chat.end_of_msg, images=chat.images, text_view=chat.reply)
    stream = _timed(ctx, handle, t0)
    base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": ctx.model_name}
    if not body.stream:
        return await _chat_whole(ctx, body, chat, base, stream, request, handle)
    return _chat_stream(ctx, body, chat, base, stream, handle)
