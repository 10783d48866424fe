"""The published OpenAPI schema states what the server enforces: every numeric bound of a
request model as JSON Schema's minimum / maximum (exclusive ones too), exact, where it had pydantic's
raw `ge` / `le` (which JSON Schema does not know) or FastAPI's floats; so a request the schema allows
is one the server takes, and one the server refuses the schema refuses. /metrics is documented as the
Prometheus text it serves, not JSON."""
from __future__ import annotations

import json
from typing import Annotated, get_args, get_origin

import httpx
import jsonschema_rs
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from k3.serve.api import protocol
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine
from k3.text.tokenizer import train_tokenizer
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.serve.test_api_hostile import scripted_engine

# pydantic's constraint -> the JSON Schema keyword that states it
KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


@pytest.fixture(scope="module")
def server():
    tokenizer = train_tokenizer(["The quick brown fox jumps over the lazy dog.", "hello there, general"] * 4, 320)
    with ServerThread(build_app(AsyncEngine(scripted_engine(tokenizer), tokenizer), tokenizer, model_name="m")) as s:
        yield s


@pytest.fixture(scope="module")
def schema(server) -> dict:
    return httpx.get(server.url + "/openapi.json", timeout=30).json()


def enforced(tp) -> set[tuple[str, int | float]]:
    """Every numeric bound pydantic checks anywhere in a field's type (unions, lists, Annotated), as
    (JSON Schema keyword, value). Another model's fields are that model's (its own component)."""
    found, metadata = set(), []
    if isinstance(tp, FieldInfo):
        metadata, tp = list(tp.metadata), tp.annotation
    if get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        metadata += extra
    for item in metadata:
        if isinstance(item, FieldInfo):
            found |= enforced(item)
        found |= {(KEYWORDS[name], getattr(item, name)) for name in KEYWORDS
                  if isinstance(getattr(item, name, None), (int, float))}
    for arg in get_args(tp):
        found |= enforced(arg)
    return found


def nodes(value):
    """Every object in a JSON value."""
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from nodes(v)
    elif isinstance(value, list):
        for v in value:
            yield from nodes(v)


def published(field_schema: dict) -> set[tuple[str, int | float]]:
    return {(key, node[key]) for node in nodes(field_schema) for key in KEYWORDS.values() if key in node}


def validator(schema: dict, name: str):
    return jsonschema_rs.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                               "components": schema["components"]})


def test_no_schema_carries_pydantic_bound_names(schema):
    raw = [node for node in nodes(schema) if "type" in node and set(node) & set(KEYWORDS)]
    assert not raw, raw


def test_every_bound_the_server_enforces_is_published_exactly(schema):
    components = schema["components"]["schemas"]
    bounded = {}
    for name, component in components.items():
        model = getattr(protocol, name, None)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for field_name, field in model.model_fields.items():
            want = enforced(field)
            got = published(component["properties"][field.alias or field_name])
            assert got == want, (name, field_name)
            if want:
                bounded[f"{name}.{field_name}"] = want
    # the fields once published as ge / le, among the others
    for field in ("CompletionRequest.prompt", "CompletionRequest.logprobs", "CompletionRequest.max_tokens",
                  "CompletionRequest.seed", "ChatCompletionRequest.seed", "ChatCompletionRequest.max_tokens",
                  "ChatCompletionRequest.max_completion_tokens", "ChatCompletionRequest.top_logprobs",
                  "ChatCompletionRequest.top_p", "ChatCompletionRequest.top_k", "ChatCompletionRequest.n"):
        assert field in bounded, field
    seed = published(components["CompletionRequest"]["properties"]["seed"])
    assert seed == {("minimum", -(2**63)), ("maximum", 2**63 - 1)}  # not float(2**63)
    assert all(type(v) is int for _, v in seed)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 1}
# (route, body): one past each bound, and the bound itself
REFUSED = [("completions", {**COMPLETION, "logprobs": 100}), ("completions", {**COMPLETION, "logprobs": -1}),
           ("completions", {**COMPLETION, "prompt": [5, -1]}), ("completions", {**COMPLETION, "prompt": [[-3]]}),
           ("completions", {**COMPLETION, "seed": 2**63}), ("completions", {**COMPLETION, "seed": -(2**63) - 1}),
           ("completions", {**COMPLETION, "max_tokens": 2**31}), ("completions", {**COMPLETION, "top_k": -1}),
           ("chat/completions", {**CHAT, "max_tokens": 0}), ("chat/completions", {**CHAT, "n": 2}),
           ("chat/completions", {**CHAT, "max_completion_tokens": 0}),
           ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}),
           ("chat/completions", {**CHAT, "top_p": 0.0}), ("chat/completions", {**CHAT, "temperature": 2.5})]
TAKEN = [("completions", {**COMPLETION, "logprobs": 5}), ("completions", {**COMPLETION, "prompt": [5, 0]}),
         ("completions", {**COMPLETION, "seed": 2**63 - 1}), ("completions", {**COMPLETION, "seed": -(2**63)}),
         ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 20}),
         ("chat/completions", {**CHAT, "max_completion_tokens": 1, "n": 1, "top_p": 1.0, "temperature": 2.0})]


def test_the_schema_refuses_what_the_server_refuses(server, schema):
    for route, body in REFUSED + TAKEN:
        model = "CompletionRequest" if route == "completions" else "ChatCompletionRequest"
        allowed = validator(schema, model).is_valid(body)
        r = httpx.post(f"{server.url}/v1/{route}", content=json.dumps(body), timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == (200 if allowed else 400), (body, r.text)
        assert allowed == ((route, body) in TAKEN), body


def test_metrics_is_documented_as_the_text_it_serves(server, schema):
    content = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"] and content["text/plain"]["schema"] == {"type": "string"}
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].split(";")[0] == "text/plain"
    assert "k3_requests_running" in r.text
