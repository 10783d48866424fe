"""Fixtures of the vision server tests (test_images.py, test_videos.py): a tiny multimodal model, a
tokenizer for it, and a server with its processor."""
from __future__ import annotations

import pytest

from k3.media.image_processor import ImageProcessor
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.text.tokenizer import train_tokenizer
from tests.model.vision.test_multimodal import tiny_multimodal

CORPUS = ["What is shown in the picture?", "A red square and two blue circles.", "How many shapes are there?"]
VOCAB, PLACEHOLDER = 340, 339  # the tokenizer's 330 ids, then room for the placeholder id


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, 330)


@pytest.fixture(scope="module")
def vl_model():
    """The text model cut to 4 layers, KDA and MLA twice each: what these tests check (placeholders,
    media in the prefix cache, the encoder budget) is per layer kind, not per layer."""
    model = tiny_multimodal(vocab_size=VOCAB, num_hidden_layers=4, kda_layers=[1, 3], full_attn_layers=[2, 4])
    model.config.media_placeholder_token_id = PLACEHOLDER
    return model


@pytest.fixture(scope="module")
def server(vl_model, tokenizer):
    engine = LLMEngine(vl_model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=32))
    app = build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="k3-tiny-vl")
    app.state.ctx.images = ImageProcessor.from_vision_config(vl_model.config.vision_config, max_pixels=200 * 200)
    with ServerThread(app) as s:
        s.images, s.ctx = app.state.ctx.images, app.state.ctx
        yield s, engine
