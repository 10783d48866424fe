"""One "prompt + max_tokens fits the model" check (`k3.serve.request.fit_model_length`): the API,
the scheduler and `k3 chat` all ask it, and the API's errors stay OpenAI's 400
context_length_exceeded, blaming the prompt (or messages) when it alone fills the model and
max_tokens otherwise. The routes read the model length and the image placeholder id from the
`AsyncEngine`'s public properties, never from the engine's internals."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from k3.serve.api.server import ServerThread, build_app
from k3.serve.cache_manager import CacheManager
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.serve.page_layout import PageLayout
from k3.serve.request import ContextLengthError, Request, fit_model_length
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Scheduler
from k3.text.tokenizer import train_tokenizer
from tests.serve.fakes import FakeModel, fake_config, one_torch_thread, scripted_chat_model  # noqa: F401 (autouse)

SERVE = Path(__file__).resolve().parents[2] / "k3" / "serve"
MAX_LEN = 128
SERVED_LEN = 1024  # a chat prompt of this tiny tokenizer takes some 330 tokens


def test_fit_model_length():
    assert fit_model_length(10, None, 48) == 38  # None: all the room the model leaves
    assert fit_model_length(10, 38, 48) == 38
    assert fit_model_length(48, 0, 48) == 0  # a prompt only scored may fill the model
    with pytest.raises(ContextLengthError, match=re.escape("the prompt (48 tokens) fills the model length (48)")) as e:
        fit_model_length(48, None, 48)
    assert e.value.prompt_fills
    with pytest.raises(ContextLengthError) as e:
        fit_model_length(50, 5, 48)
    assert e.value.prompt_fills
    with pytest.raises(ContextLengthError, match=re.escape("prompt (10 tokens) + max_tokens (39) exceeds the model "
                                                           "length (48)")) as e:
        fit_model_length(10, 39, 48)
    assert not e.value.prompt_fills and isinstance(e.value, ValueError)


def test_scheduler_asks_the_same_check():
    layout = PageLayout.from_config(fake_config(), 4)
    s = Scheduler(CacheManager(layout, 256, hash_block_size=8), max_model_len=MAX_LEN)
    s.add_request(Request("a", [1] * 10, SamplingParams(max_tokens=MAX_LEN - 10)))
    with pytest.raises(ContextLengthError) as e:
        s.add_request(Request("b", [1] * 10, SamplingParams(max_tokens=MAX_LEN - 9)))
    with pytest.raises(ContextLengthError) as same:
        fit_model_length(10, MAX_LEN - 9, MAX_LEN)
    assert str(e.value) == str(same.value)


def test_async_engine_exposes_what_routes_need():
    engine = LLMEngine(FakeModel(), EngineConfig(block_size=4, hash_block_size=8, max_model_len=MAX_LEN))
    front = AsyncEngine(engine, tokenizer=None)
    assert front.max_model_len == engine.max_model_len == MAX_LEN
    assert front.media_placeholder_token_id is None  # text only


def test_routes_and_chat_use_public_engine_attributes_and_the_one_check():
    routes = (SERVE / "api" / "routes.py").read_text()
    assert "engine.engine" not in routes and not re.search(r"engine\._\w", routes)
    for path in (SERVE / "api" / "routes.py", SERVE / "scheduler.py", SERVE / "chat_cli.py"):
        source = path.read_text()
        assert "fit_model_length(" in source, path.name


@pytest.fixture(scope="module")
def server():
    tokenizer = train_tokenizer(["The quick brown fox jumps over the lazy dog."] * 4, 330)
    model = scripted_chat_model(tokenizer, "Fine.")
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=SERVED_LEN))
    with ServerThread(build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="m")) as s:
        yield s


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [1] * SERVED_LEN}, "prompt"),
    ("/v1/completions", {"prompt": [1] * 8, "max_tokens": SERVED_LEN}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * SERVED_LEN}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": SERVED_LEN}, "max_tokens"),
])
def test_api_blames_the_prompt_or_max_tokens(server, path, body, param):
    error = _error(httpx.post(server.url + path, json={"model": "m", **body}, timeout=30))
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", param)
    assert error["message"].endswith(f"the model length ({SERVED_LEN})")
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == SERVED_LEN
