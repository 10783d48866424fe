"""The 200 responses as `/openapi.json` publishes them, OpenAI's shapes: a client (or schemathesis,
tests/serve/test_schemathesis.py) can check every success body against them. Documentation only:
the routes build their JSON themselves, so serving never filters a field through these models.
A streamed reply (`stream: true`) is `text/event-stream`: its events carry the `*Chunk` shapes."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]  # RequestStatus values, and tool_calls


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class LegacyLogprobs(BaseModel):
    """/v1/completions' `logprobs` (echoed prompt first: its first token's logprob is null)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: LegacyLogprobs | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning: str | None = None  # the think channel (vLLM's name); reasoning_content is the same text
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_errors: list[dict] | None = None  # calls that failed their tool's schema (k3/serve/api/tool_calls.py)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def ok(model: type[BaseModel], description: str, stream: bool = False) -> dict:
    """An OpenAPI `responses` entry for 200: `model` as JSON, and server-sent events when it streams."""
    entry: dict = {"model": model, "description": description}
    if stream:
        # one server-sent event, as SSE readers (and schemathesis) parse them: its data is a JSON chunk or [DONE]
        entry["content"] = {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}}
    return {200: entry}
