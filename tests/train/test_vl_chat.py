"""A VL run's training documents and held-out prompts are what `/v1/chat/completions` renders:
the unmodified `openai` client sends one image and a question to a server over the run's model and
tokenizer; the prompt the engine receives equals the training conversation token for token up to
the reply (thinking on, the server's default, and off), its image equals the trainer's pixels at
the placeholders' offset, and the reply's content equals the trainer's held-out answer."""
from __future__ import annotations

import base64
import dataclasses
import io

import openai
import pytest

from k3.data import shapes_corpus as corpus
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.train.vl_trainer import VLTrainer
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.helpers.train import quiet
from tests.train.test_vl_trainer import micro_settings


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlchat")
    t = VLTrainer(micro_settings(root, "run"), progress=False, log=quiet)  # untrained: the forms, not the skill
    t.model.eval()
    return t


@pytest.fixture(scope="module")
def server(trainer):
    engine = LLMEngine(trainer.model, EngineConfig(block_size=4, max_num_batched_tokens=256))
    received = []
    add_request = engine.add_request

    def recording(prompt, params, **kw):
        received.append((list(prompt), kw.get("images", ())))
        return add_request(prompt, params, **kw)

    engine.add_request = recording
    with ServerThread(build_app(AsyncEngine(engine, trainer.tokenizer), trainer.tokenizer, model_name="vl")) as s:
        yield s, received


def data_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("thinking", [None, True, False])
def test_the_chat_endpoint_renders_the_training_form(trainer, server, thinking):
    s, received = server
    example = next(iter(corpus.examples("heldout", 1, 3, size=trainer.s.image_size)))
    encoder = dataclasses.replace(trainer.encoder, thinking=thinking is not False)
    doc = encoder.document(example.image, [corpus.QA(example.qtype, example.question, example.answer)])
    reply_start = int(doc.mask.argmax())  # the first token the model must emit
    extra = {} if thinking is None else {"chat_template_kwargs": {"thinking": thinking}}
    received.clear()
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="vl", temperature=0, max_tokens=encoder.reply_overhead + trainer.s.max_answer_tokens, extra_body=extra,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(example.image)}},
                                               {"type": "text", "text": example.question}]}])
    ((prompt, images),) = received
    assert prompt == doc.ids[:reply_start].tolist() == encoder.prompt_ids(example.question, 4)
    (image,) = images
    pixels, grid, count = encoder.image(example.image)
    assert prompt[image.offset:image.offset + count] == [trainer.mm_config.media_placeholder_token_id] * count
    assert tuple(image.grid_thw) == tuple(grid) and image.pixel_values.equal(pixels)
    # the trainer's held-out answer is the endpoint's reply
    original, trainer.encoder = trainer.encoder, encoder
    try:
        assert reply.choices[0].message.content.strip() == trainer.answer([example])[0]
    finally:
        trainer.encoder = original
