"""Schemathesis against a live server (real uvicorn on loopback; the scripted stand-in model, and with
`-m slow` a real tiny K3 model): requests generated from the published OpenAPI schema, valid and
invalid, never get a 5xx, and every response matches the schema the server publishes for its status:
the 200s OpenAI's completion / chat completion / model list objects or their server-sent events
(k3/serve/api/responses.py), the errors OpenAI's error JSON."""
from __future__ import annotations

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

from k3.model.transformer import K3ForCausalLM
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.text.tokenizer import train_tokenizer
from tests.helpers.models import randomized, small_config
from tests.serve.fakes import one_torch_thread, scripted_chat_model  # noqa: F401 (autouse fixture)

EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}  # per operation: seconds in all


@pytest.fixture(scope="module", params=["scripted", pytest.param("tiny", marks=pytest.mark.slow)])
def api(request):
    tokenizer = train_tokenizer(["The quick brown fox jumps over the lazy dog."] * 4, 300)
    if request.param == "scripted":
        model = scripted_chat_model(tokenizer, "Fine, thanks.")
    else:  # a real K3 model (KDA, MLA, MoE), random weights: replies are noise the parser must survive
        torch.manual_seed(0)
        model = randomized(K3ForCausalLM(small_config(vocab_size=tokenizer.get_vocab_size()))).eval()
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
    for name in OPERATIONS:  # a 200 schema each, so the checks above validate the success bodies too
        method, path = name.split()
        ok = api.raw_schema["paths"][path][method.lower()]["responses"]["200"]["content"]
        assert ok["application/json"]["schema"].get("$ref"), name
        assert ("text/event-stream" in ok) == (method == "POST"), name
