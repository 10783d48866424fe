"""Loopback load: 200 concurrent streaming requests against k3-tiny all complete (no 5xx), and
overload beyond the queue bound is refused with 429 + Retry-After, never a crash."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.text.tokenizer import train_tokenizer
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["Load testing a tiny model on loopback, two hundred clients at once."] * 4, 300)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=tokenizer.get_vocab_size())).eval()


async def stream_one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, int]:
    body = {"model": "k3-tiny", "prompt": f"hi {i}", "max_tokens": 3, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.headers.get("retry-after"), 0
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    usage = json.loads(lines[-2][len("data: "):])["usage"]
    return 200, None, usage["completion_tokens"]


async def fire(url: str, n: int) -> list[tuple[int, str | None, int]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, i) for i in range(n)))


def test_200_concurrent_streams(model, tokenizer):
    engine = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                                           max_waiting=256, max_model_len=256))
    with ServerThread(build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="k3-tiny")) as server:
        results = asyncio.run(fire(server.url, 200))
    assert [r[0] for r in results] == [200] * 200
    assert all(r[2] == 3 for r in results)
    assert engine.cache.pool.num_used == 0 and not engine.scheduler.requests


def test_overload_gets_429_with_retry_after(model, tokenizer):
    engine = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=2, max_waiting=4, max_model_len=256))
    with ServerThread(build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="k3-tiny")) as server:
        results = asyncio.run(fire(server.url, 40))
        statuses = [r[0] for r in results]
        assert set(statuses) == {200, 429} and statuses.count(429) >= 20
        assert all(r[1] == "1" for r in results if r[0] == 429)
        assert httpx.get(server.url + "/health").status_code == 200  # still serving
    assert engine.cache.pool.num_used == 0
