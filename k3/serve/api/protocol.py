"""OpenAI-compatible request models (pydantic) and the error shape (APIError: errors.py).

Validation happens here so bad input is a 400 with OpenAI's error JSON
`{"error": {"message", "type", "param", "code"}}`, never a 5xx. Fields we accept but cannot
honour are rejected explicitly rather than silently ignored (n > 1, penalties, logit_bias). Numbers and booleans are as JSON Schema has them: `true` is no integer and
`"1"` no number (`2.0` is the integer 2);
every string in a body must be valid Unicode (a lone surrogate such as "\\ud800" cannot be
tokenized) and no value may nest deeper than MAX_DEPTH; tool `parameters` must be a valid JSON
Schema.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    field_validator,
    model_validator,
)

from k3.sampling import MAX_TEMPERATURE
from k3.serve.api.errors import APIError  # noqa: F401 (the error shape's home; re-exported)
from k3.serve.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from k3.text.tool_schema import compile_parameters
from k3.text.xtml import REASONING_EFFORT

MAX_INT = 2**31 - 1
MAX_DEPTH = 64  # JSON nesting (objects and lists), tool schemas and call arguments included


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_text(text: str, path: str) -> None:
    try:
        text.isascii() or text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{path or 'a string'}: not valid Unicode (a lone surrogate such as \\ud800)") from None


def check_json_value(value: Any, where: str = "") -> None:
    """Raise ValueError naming the place of the first lone surrogate or of nesting beyond MAX_DEPTH.
    Iterative, so a deep value cannot exhaust the stack while being checked."""
    if isinstance(value, str):
        return _check_text(value, where)
    stack = [(value, where, 0)] if isinstance(value, (dict, list)) else []
    while stack:
        v, path, depth = stack.pop()
        if depth >= MAX_DEPTH:
            raise ValueError(f"{path or 'the body'}: nested deeper than {MAX_DEPTH} levels")
        for k, item in v.items() if isinstance(v, dict) else enumerate(v):
            if isinstance(k, str):
                _check_text(k, path)
            if isinstance(item, str):
                if not item.isascii():  # the path is built only for the strings that need a look
                    _check_text(item, _join(path, k))
            elif isinstance(item, (dict, list)):
                stack.append((item, _join(path, k), depth + 1))


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response (OpenAI's shape); published in the OpenAPI schema."""
    error: ErrorDetail


class _Request(BaseModel):
    # unknown fields are ignored (clients send vendor extensions); known ones are type-checked
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


def _integer(value):
    """JSON Schema's integer: pydantic's lax int would also take `true` and `"1"`."""
    if isinstance(value, (bool, str)):  # a ValueError: pydantic makes it a 400, a TypeError would be a 500
        raise ValueError("Input should be an integer, not a boolean or a string")  # noqa: TRY004
    return value


def integer(ge: int | None = None, le: int | None = None):
    """A JSON Schema integer within [ge, le]. The bounds sit on the int inside the validator: put on
    the validated type instead, pydantic still enforces them but publishes them as `ge`/`le`, words
    JSON Schema does not have (so the schema allowed `logprobs: 100`), not as `minimum`/`maximum`."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integer)]


Integer = integer()

# what the published schema states, so that a request built from it is one the server accepts
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = integer(ge=0)
Unsupported = "accepted for compatibility; only the default is supported"


class _Sampling(_Request):
    model: str
    temperature: StrictFloat | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: integer(0, MAX_INT) = 0  # extension (vLLM-style); 0 = off
    n: integer(1, 1) = Field(1, description="one choice per request")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: integer(-(2**63), 2**63 - 1) | None = None
    presence_penalty: StrictFloat = Field(0.0, ge=0.0, le=0.0, description=Unsupported)
    frequency_penalty: StrictFloat = Field(0.0, ge=0.0, le=0.0, description=Unsupported)
    logit_bias: dict[str, StrictFloat] | None = Field(None, max_length=0, description=Unsupported)
    user: str | None = None
    ignore_eos: StrictBool = False  # extension

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data):
        check_json_value(data)
        return data

    @model_validator(mode="after")
    def _supported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    # text or token ids; a batch of prompts may hold one (one prompt per request)
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)])
    max_tokens: integer(0, MAX_INT) | None = Field(16, description="0 (with echo): only score the prompt")
    logprobs: integer(0, 5) | None = None
    # the prompt before the completion in `text`, and with logprobs its tokens' logprobs before the
    # completion's (the first token's null), as vLLM serves them: loglikelihood scoring
    echo: StrictBool = False
    suffix: str | None = Field(None, max_length=0, description=Unsupported)

    @model_validator(mode="after")
    def _single_prompt(self):
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            self.prompt = self.prompt[0]
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 returns nothing without echo=true")
        return self


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _bounded(cls, v: str) -> str:
        """Arguments are JSON in a string, parsed when the turn is rendered: bound their nesting here
        (invalid JSON is reported by the chat format)."""
        try:
            check_json_value(json.loads(v), "arguments")
        except RecursionError:
            raise ValueError(f"arguments: nested deeper than {MAX_DEPTH} levels") from None
        except json.JSONDecodeError:
            pass
        return v


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageURL(_Request):
    url: str  # a data:image/png;base64,... or data:image/jpeg;base64,... URI (k3/serve/api/images.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor's budget decides


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Request):
    url: str  # a data:video/mp4;base64,... (or webm, animated gif/webp/png) URI (k3/serve/api/videos.py)


class VideoPart(_Request):
    type: Literal["video_url"]
    video_url: VideoURL


Content = str | list[Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]]
TextContent = str | list[TextPart]  # what an assistant message may hold


class SystemMessage(_Request):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Request):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Request):
    role: Literal["assistant"]
    content: TextContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # the name some clients use for `reasoning`


class ToolMessage(_Request):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1)


# one schema per role (the published schema says which fields each role needs)
ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, v: dict | None) -> dict | None:
        if v is not None:
            compile_parameters(v)  # also external or unresolvable $refs, bad patterns: 400 now, not 500 later
        return v


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Request):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatTemplateKwargs(BaseModel):
    """Options of K3's chat template (k3/text/xtml.py); unknown keys are an error, not ignored."""
    model_config = ConfigDict(extra="forbid")
    thinking: StrictBool = Field(True, description="false: no think channel, no effort message")
    thinking_effort: Literal["low", "high", "max"] | None = Field(
        None, description="the official encoder's effort keyword; given with reasoning_effort, the two must agree")


# OpenAI's reasoning_effort values; K3 has three levels (the mapping is REASONING_EFFORT in k3/text/xtml.py)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: integer(1, MAX_INT) | None = None
    max_completion_tokens: integer(1, MAX_INT) | None = None
    logprobs: StrictBool = False
    top_logprobs: integer(0, 20) | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: two tools have the same name")
        if self.tool_choice not in (None, "none", "auto"):
            if not names:
                raise ValueError("tool_choice requires tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        return self

    def thinking(self, default: ChatTemplateKwargs | None = None) -> bool:
        """The request's own chat_template_kwargs, else the server's defaults, else the template's."""
        kwargs = self.chat_template_kwargs if self.chat_template_kwargs is not None else default
        return kwargs is None or kwargs.thinking

    def effort(self, default: ChatTemplateKwargs | None = None) -> str | None:
        """The reasoning_effort to render: the request's, else chat_template_kwargs' thinking_effort
        (the request's own, else the server's defaults); ValueError when the two disagree."""
        kwargs = self.chat_template_kwargs if self.chat_template_kwargs is not None else default
        official = kwargs.thinking_effort if kwargs is not None else None
        if official is None:
            return self.reasoning_effort
        if self.reasoning_effort is not None and REASONING_EFFORT[self.reasoning_effort] != official:
            raise ValueError(f"reasoning_effort {self.reasoning_effort!r} and chat_template_kwargs.thinking_effort "
                             f"{official!r} disagree")
        return self.reasoning_effort or official

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
