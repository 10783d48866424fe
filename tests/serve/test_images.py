"""Images in the server (DESIGN §7): the unmodified `openai` client sends an image in a chat
request and gets an answer; the prefix cache keys images by their pixels (the same image hits,
another image of the same size does not); every bad image is a 400 in OpenAI's error shape; the
engine's output with an image equals the multimodal model's own greedy continuation, whole or in
prefill chunks that split the image."""
from __future__ import annotations

import base64
import dataclasses
import io

import httpx
import openai
import pytest
import torch
from PIL import Image

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.serve.api.images import decode_image_bytes
from k3.serve.api.media_fetch import FetchPolicy
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, ImageInput, LLMEngine
from k3.serve.sampling import SamplingParams
from tests.serve.conftest import PLACEHOLDER, VOCAB  # the vision fixtures: tokenizer, vl_model, server
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.serve.test_media_fetch import image_host, png_bytes


def picture(seed: int, size=(56, 84)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy())


def data_uri(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def ask(url: str, text: str = "What is shown in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_client_sends_an_image_and_gets_an_answer(server):
    s, _ = server
    c = client(s)
    kw = {"model": "k3-tiny-vl", "messages": ask(data_uri(picture(0))), "max_tokens": 6, "temperature": 0,
          "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"thinking": False}}}
    reply = c.chat.completions.create(**kw)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    # one placeholder per merged row of the picture, counted as prompt tokens
    text_only = c.chat.completions.create(**{**kw, "messages": [{"role": "user", "content": "What is shown in the picture?"}]})
    assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + s.images.placeholder_counts(picture(0))[0]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(**kw, stream=True)
                       if chunk.choices)
    assert streamed == reply.choices[0].message.content


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(server):
    s, _ = server
    c = client(s)
    kw = {"model": "k3-tiny-vl", "max_tokens": 2, "temperature": 0, "extra_body": {"ignore_eos": True}}

    def image_then_text(image: Image.Image, fmt: str = "PNG") -> list[dict]:  # a hit past the image must span it
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image, fmt)}},
                                             {"type": "text", "text": "How many shapes are there? " * 3}]}]

    first = c.chat.completions.create(messages=image_then_text(picture(1)), **kw)
    again = c.chat.completions.create(messages=image_then_text(picture(1)), **kw)
    other = c.chat.completions.create(messages=image_then_text(picture(2)), **kw)  # the same size
    jpeg = c.chat.completions.create(messages=image_then_text(picture(1), "JPEG"), **kw)  # lossy: other pixels
    image = s.images.placeholder_counts(picture(1))[0]
    prompt = first.usage.prompt_tokens
    assert again.usage.prompt_tokens == other.usage.prompt_tokens == jpeg.usage.prompt_tokens == prompt
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit >= prompt - 8  # all but the last hash block at most
    for miss in (other, jpeg):  # at most the text before the image, up to a hash block (8) past it
        assert miss.usage.prompt_tokens_details.cached_tokens < hit - image - 8


def test_the_cache_key_is_what_the_tower_sees(server):
    """Keys hash the processed tower input: two palette images with the same indices and other
    palettes differ, a re-encoded PNG of the same pixels does not, and an image never shares a key
    with a one-frame video of the same picture (its clip is another tower input)."""
    import numpy as np

    from k3.serve.api.images import prepare_image
    from k3.serve.api.videos import prepare_video

    processor = server[0].images
    indices = np.random.RandomState(0).randint(0, 4, (84, 56), dtype=np.uint8)
    palettes = ([255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 0], [0, 0, 0, 255, 255, 255, 128, 128, 128, 0, 255, 255])
    keyed = []
    for palette in palettes:
        image = Image.fromarray(indices, "P")
        image.putpalette(palette)
        keyed.append(prepare_image(data_uri(image), "p", processor).digests[0])
    assert keyed[0] != keyed[1]
    rgb = picture(7)
    buf = io.BytesIO()
    rgb.save(buf, format="PNG", compress_level=0)
    plain = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert prepare_image(plain, "p", processor).digests == prepare_image(data_uri(rgb), "p", processor).digests
    still = prepare_video(plain, "p", processor)[0].digests
    assert len(still) == 1 and still[0] != prepare_image(plain, "p", processor).digests[0]


def test_an_image_url_is_fetched_when_the_server_allows_its_host(server):
    """`k3 serve --allowed-media-domains`: the openai client sends an http URL; the reply equals the
    one for the same picture inline, and the pixels key the cache (the second request hits)."""
    s, _ = server
    c = client(s)
    kw = {"model": "k3-tiny-vl", "max_tokens": 4, "temperature": 0,
          "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"thinking": False}}}
    with image_host() as host:
        s.ctx.media_fetch = FetchPolicy(frozenset({"127.0.0.1"}), timeout=5)
        try:
            fetched = c.chat.completions.create(messages=ask(f"{host}/ok.png"), **kw)
            inline = c.chat.completions.create(messages=ask(data_uri(Image.open(io.BytesIO(png_bytes())))), **kw)
            with pytest.raises(openai.BadRequestError, match="HTTP 404"):
                c.chat.completions.create(messages=ask(f"{host}/missing.png"), **kw)
        finally:
            s.ctx.media_fetch = None
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    assert inline.usage.prompt_tokens_details.cached_tokens >= inline.usage.prompt_tokens - 8


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,aGVsbG8=", "could not be decoded"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "unsupported image type 'image/gif'"),
    ("data:image/png,rawbytes", "must be base64-encoded"),
    ("https://example.com/cat.png", "not fetched (fetching is off"),
    ("file:///etc/passwd", "not fetched"),
    (None, "over the limit"),  # 300 x 300 pixels against the test server's 200 x 200 limit
])
def test_bad_images_get_a_400_with_a_clear_message(server, url, message):
    error = bad_request(server[0], ask(url or data_uri(picture(3, size=(300, 300)))))
    assert message in error["message"] and "image_url" in error["message"]  # names the part


@pytest.mark.parametrize("part, where", [
    ({"type": "image_url", "image_url": {}}, "messages[0].content[0].image_url.url: Field required"),
    ({"type": "image_url", "image_url": "data:image/png;base64,AA"}, "messages[0].content[0].image_url: "),
    ({"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}}, "messages[0].content[0].image_url.detail"),
    ({"type": "audio", "audio": {}}, "messages[0].content[0]: Input tag 'audio'"),
])
def test_a_malformed_part_is_named_by_its_path(server, part, where):
    """Pydantic reports a content union's first branch ("str") first: the error names the deepest
    location the request has instead."""
    error = bad_request(server[0], [{"role": "user", "content": [part]}])
    assert error["message"].startswith(where), error
    assert error["param"] == where.split(":")[0]


def bad_request(s, messages: list[dict]) -> dict:
    """The error object of a chat request the server must refuse with a 400."""
    r = httpx.post(s.url + "/v1/chat/completions", json={"model": "k3-tiny-vl", "messages": messages, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_a_text_model_refuses_images_with_a_400(tokenizer):
    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=VOCAB)).eval()
    engine = LLMEngine(model, EngineConfig(block_size=4))
    with ServerThread(build_app(AsyncEngine(engine, tokenizer), tokenizer, model_name="text")) as s:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                       json={"model": "text", "messages": ask(data_uri(picture(0))), "max_tokens": 2})
    assert r.status_code == 400 and "vision tower" in r.json()["error"]["message"]


def test_engine_output_equals_the_model_whole_or_chunked(vl_model):
    """Greedy tokens through the engine (prefill in chunks of 5, which split the 6-row image) equal
    the multimodal model's own continuation; the same prompt with another image differs."""
    from tests.model.vision.helpers import pixels

    grid = (1, 4, 6)
    pv, _ = pixels([grid], vl_model.config.vision_config.patch_size, seed=1)
    prompt = [5, 6, 7] + [PLACEHOLDER] * 6 + [8, 9, 10, 11]
    with torch.no_grad():
        tokens = list(prompt)
        for _ in range(5):
            logits = vl_model(torch.tensor([tokens]), pixel_values=pv, grid_thws=torch.tensor([grid]))
            tokens.append(int(logits[0, -1].argmax()))
    for budget in (64, 5):
        engine = LLMEngine(vl_model, EngineConfig(block_size=4, hash_block_size=4, max_num_batched_tokens=budget))
        engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                           images=[ImageInput(3, pv, grid, b"one")])
        out = []
        while engine.has_unfinished:
            out += [t.token_id for o in engine.step() for t in o.new_tokens]
        assert out == tokens[len(prompt):]
        assert not engine.runner._media  # freed with the request
    with pytest.raises(ValueError, match="needs 6 placeholder tokens"):
        engine.add_request(prompt, SamplingParams(max_tokens=1), images=[ImageInput(2, pv, grid, b"one")])
    with pytest.raises(ValueError, match="image placeholder tokens"):
        engine.add_request(prompt, SamplingParams(max_tokens=1))


def test_the_tower_runs_only_for_images_a_chunk_covers(vl_model):
    """Each image is encoded when a prefill chunk first covers its placeholders, in one tower call
    for all a chunk covers; images inside a prefix-cache hit are never encoded; the output is the
    same either way."""
    from tests.model.vision.helpers import pixels

    grids = [(1, 4, 6), (1, 2, 4)]  # 6 and 2 placeholders
    pv, _ = pixels(grids, vl_model.config.vision_config.patch_size, seed=2)
    first, second = pv[:24], pv[24:]
    prompt = [5, 6] + [PLACEHOLDER] * 6 + [7, 8, 9, 10] + [PLACEHOLDER] * 2 + [11] * 10
    images = [ImageInput(2, first, grids[0], b"one"), ImageInput(12, second, grids[1], b"two")]
    engine = LLMEngine(vl_model, EngineConfig(block_size=4, hash_block_size=4, max_num_batched_tokens=8))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompt, params, images=images)
    engine.step()  # tokens 0-7: the first image only
    assert engine.runner.encoder_counts == {"images": 1, "patches": 24}
    while engine.has_unfinished:
        engine.step()
    assert engine.runner.encoder_counts == {"images": 2, "patches": 32}
    again = engine.add_request(prompt, params, images=images)
    while engine.has_unfinished:
        engine.step()
    assert again.num_cached_tokens >= 20 and engine.runner.encoder_counts["images"] == 2  # both images were hits
    assert again.output_token_ids == request.output_token_ids


def test_the_encoder_budget_spreads_tower_work_over_steps(vl_model):
    """`max_num_encoder_tokens`: a step starts encoding images of at most that many placeholders
    (always one, for progress): chunks stop before the next image instead; outputs are unchanged."""
    from tests.model.vision.helpers import pixels

    grids = [(1, 4, 6), (1, 4, 6)]  # 6 placeholders each
    pv, _ = pixels(grids, vl_model.config.vision_config.patch_size, seed=3)
    prompt = [5, 6] + [PLACEHOLDER] * 6 + [7, 8] + [PLACEHOLDER] * 6 + [9, 10]
    images = [ImageInput(2, pv[:24], grids[0], b"a"), ImageInput(10, pv[24:], grids[1], b"b")]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def run(encoder_budget):
        engine = LLMEngine(vl_model, EngineConfig(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False,
                                                  max_num_encoder_tokens=encoder_budget))
        requests = [engine.add_request(prompt, params, images=images), engine.add_request([4] * 3 + prompt, params,
                    images=[ImageInput(i.offset + 3, i.pixel_values, i.grid_thw, i.digest) for i in images])]
        per_step = []
        while engine.has_unfinished:
            before = engine.runner.encoder_counts["images"]
            engine.step()
            per_step.append(engine.runner.encoder_counts["images"] - before)
        return [r.output_token_ids for r in requests], per_step

    free, free_steps = run(None)
    capped, capped_steps = run(6)
    assert free_steps[0] == 4  # both requests' prompts, whole, in the first step
    assert capped_steps[:4] == [1, 1, 1, 1] and sum(capped_steps) == 4  # one image a step
    assert capped == free
    with pytest.raises(ValueError, match="max_num_encoder_tokens must be >= 1"):
        LLMEngine(vl_model, EngineConfig(max_num_encoder_tokens=0))


def test_speculative_decoding_with_images_equals_plain_decoding(vl_model):
    """A vision model serves with a draft (its language model's): the draft reads the image rows
    where the target did, and greedy outputs equal plain decoding (both batch-invariant)."""
    from k3.model.draft import EagleDraft
    from tests.model.vision.helpers import pixels

    grid = (1, 4, 6)
    pv, _ = pixels([grid], vl_model.config.vision_config.patch_size, seed=4)
    prompts = [[5, 6] + [PLACEHOLDER] * 6 + [7, 8, 9], [9, 8] + [PLACEHOLDER] * 6 + [5]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(engine):
        requests = [engine.add_request(p, params, images=[ImageInput(2, pv, grid, b"spec")]) for p in prompts]
        while engine.has_unfinished:
            engine.step()
        return [r.output_token_ids for r in requests]

    config = EngineConfig(block_size=4, max_num_batched_tokens=8, batch_invariant=True)
    expected = run(LLMEngine(vl_model, config))
    torch.manual_seed(1)
    draft = EagleDraft(vl_model.language_model.config).eval()
    engine = LLMEngine(vl_model, dataclasses.replace(config, num_speculative_tokens=3), draft=draft)
    seen = []
    advance = engine.runner.speculator.advance
    engine.runner.speculator.advance = lambda *a, inputs=None: (seen.append(inputs is not None), advance(*a, inputs=inputs))
    assert run(engine) == expected
    assert any(seen) and engine.runner.spec_counts["drafted"] > 0


@pytest.mark.parametrize("orientation, upright", [
    (1, lambda im: im), (3, lambda im: im.transpose(Image.Transpose.ROTATE_180)),
    (6, lambda im: im.transpose(Image.Transpose.ROTATE_270)), (8, lambda im: im.transpose(Image.Transpose.ROTATE_90))])
def test_a_photo_is_read_upright_by_its_exif_orientation(orientation, upright):
    """A phone's JPEG stores the sensor's pixels and an EXIF Orientation tag: the model sees the
    picture as a viewer shows it (size and pixels), and the same upright pixels hit the same cache key."""
    raw = picture(3, size=(56, 28))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    raw.save(buf, format="PNG", exif=exif)
    decoded = decode_image_bytes(buf.getvalue(), "messages[0].content[0]", max_pixels=10**6).image
    want = upright(raw)
    assert decoded.size == want.size and decoded.tobytes() == want.convert(decoded.mode).tobytes()
