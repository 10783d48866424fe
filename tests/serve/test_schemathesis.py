"""Schemathesis against a live server (real uvicorn on loopback, the scripted stand-in model): requests
generated from the published OpenAPI schema, valid and invalid, never get a 5xx, and every response
matches the schema the server publishes for its status (errors: OpenAI's error JSON under 400)."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.text.tokenizer import train_tokenizer
from tests.serve.fakes import one_torch_thread, scripted_chat_model  # noqa: F401 (autouse fixture)

EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}  # per operation: seconds in all


@pytest.fixture(scope="module")
def api():
    tokenizer = train_tokenizer(["The quick brown fox jumps over the lazy dog."] * 4, 300)
    model = scripted_chat_model(tokenizer, "Fine, thanks.")
    # a short model length keeps every generated request quick, whatever max_tokens it asks for
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=48, max_num_seqs=8))
    with ServerThread(build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="m")) as server:
        yield schemathesis.openapi.from_url(server.url + "/openapi.json")


OPERATIONS = ["GET /health", "GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions"]
# invalid requests exist only where there is a body to get wrong
CASES = [(name, GenerationMode.POSITIVE) for name in OPERATIONS] + \
    [(name, GenerationMode.NEGATIVE) for name in OPERATIONS if name.startswith("POST")]


# schemathesis' pytest loaders (`schemathesis.pytest.from_fixture`) do not run under pytest 9, so each
# operation's generated cases run under hypothesis directly
@pytest.mark.parametrize("name,mode", CASES, ids=[f"{name}-{mode.value}" for name, mode in CASES])
def test_no_server_error_and_responses_match_the_schema(api, name, mode):
    operation = next(op.ok() for op in api.get_all_operations() if op.ok().label == name)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        case.call_and_validate(checks=[not_a_server_error, response_schema_conformance])

    run()


def test_every_operation_is_covered(api):
    assert sorted(op.ok().label for op in api.get_all_operations() if op.ok().path != "/metrics") == sorted(OPERATIONS)
