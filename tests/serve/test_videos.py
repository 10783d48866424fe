"""Videos in the server (DESIGN §7, docs/SERVING.md "Videos"): the unmodified `openai` client sends a
`video_url` part; the server samples its frames at the processor's `sample_fps`, prompts each
4-frame clip with its start time before the clip's placeholders, and the reply equals the
multimodal model's own greedy continuation of that prompt; the same video hits the prefix cache,
another does not; bad videos are 400s naming the part."""
from __future__ import annotations

import base64

import pytest
import torch

from k3.media.video import decode_video
from k3.serve.api.media import prepare_media
from k3.text.xtml import XTML
from tests.media.test_video import gif_bytes, mp4_bytes
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.serve.test_images import bad_request, client


def video_uri(data: bytes, media_type: str = "image/gif") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def ask(url: str, text: str = "What is shown in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


KW = {"model": "k3-tiny-vl", "max_tokens": 4, "temperature": 0,
      "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"thinking": False}}}


def test_openai_client_sends_a_video_and_gets_the_models_own_answer(server, vl_model, tokenizer):
    s, _ = server
    c = client(s)
    url = video_uri(gif_bytes(10))
    reply = c.chat.completions.create(messages=ask(url), **KW)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        messages=ask(url), stream=True, **KW) if ch.choices)
    assert streamed == reply.choices[0].message.content

    # the prompt the server builds: 10 GIF frames at 10 fps, sampled at 8 fps -> 8 frames, 2 clips
    video = decode_video(gif_bytes(10), sample_fps=s.images.sample_fps, max_pixels=s.images.max_pixels)
    assert [stamp for stamp, _ in video.clips(4)] == ["00:00:00.000", "00:00:00.500"]
    prepared = prepare_media(ask(url), s.images)
    assert [p.get("text") for p in prepared.messages[0]["content"]] == ["00:00:00.000", None, "00:00:00.500", None,
                                                                         "What is shown in the picture?"]
    assert [g[0] for g in prepared.images.grid_thws] == [4, 4]  # each clip one grid row of 4 frames
    chat = XTML(tokenizer)
    rendered = chat.render(prepared.messages, thinking=False,
                           media=prepared.images.media(vl_model.config.media_placeholder_token_id))
    assert reply.usage.prompt_tokens == len(rendered.token_ids)
    tokens = list(rendered.token_ids)
    with torch.no_grad():
        for _ in range(KW["max_tokens"]):
            logits = vl_model(torch.tensor([tokens]), pixel_values=torch.cat(prepared.images.pixel_values),
                              grid_thws=torch.tensor(prepared.images.grid_thws))
            tokens.append(int(logits[0, -1].argmax()))
    assert chat.tokenizer.decode(tokens[len(rendered.token_ids):], skip_special_tokens=False) == \
        reply.choices[0].message.content


def test_the_same_video_hits_the_prefix_cache_and_another_does_not(server):
    s, _ = server
    c = client(s)
    first = c.chat.completions.create(messages=ask(video_uri(gif_bytes(10)), "How many shapes are there? " * 3), **KW)
    again = c.chat.completions.create(messages=ask(video_uri(gif_bytes(10)), "How many shapes are there? " * 3), **KW)
    other = c.chat.completions.create(messages=ask(video_uri(gif_bytes(10, ms=90)), "How many shapes are there? " * 3),
                                      **KW)  # the same size and count, other frames sampled
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8
    assert other.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens - 30


def test_an_mp4_is_served(server):
    s, _ = server
    reply = client(s).chat.completions.create(messages=ask(video_uri(mp4_bytes(12), "video/mp4")), **KW)
    assert reply.usage.completion_tokens == 4


@pytest.mark.parametrize("url, message", [
    (video_uri(b"GIF89a broken"), "could not be decoded"),
    (video_uri(b"\x00" * 64, "video/mp4"), "could not be decoded"),
    ("data:video/avi;base64,AAAA", "unsupported video type 'video/avi'"),
    ("https://example.com/cat.mp4", "remote video URLs are not fetched"),
    (None, "over the limit of 40,000"),  # 300 x 300 frames against the test server's 200 x 200 limit
])
def test_bad_videos_get_a_400_naming_the_part(server, url, message):
    pytest.importorskip("av")
    error = bad_request(server[0], ask(url or video_uri(gif_bytes(4, size=(300, 300)))))
    assert message in error["message"] and "messages[0].content[0].video_url" in error["message"]


def test_frames_are_shrunk_as_decoded_to_what_the_processor_makes_of_them():
    """A video's kept frames are resized right after decoding (memory: never 256 full frames), and
    the tower input equals the processor's on the full-size frames."""
    from k3.media.image_processor import ImageProcessor
    from k3.serve.api.videos import prepare_video

    processor = ImageProcessor(max_patches_per_frame=64, max_pixels=400 * 400, sample_fps=None)
    data = gif_bytes(6, size=(300, 220))
    shrunk = decode_video(data, sample_fps=None, max_pixels=400 * 400,
                          frame_size=lambda w, h: (processor.plan(w, h, 64).width, processor.plan(w, h, 64).height))
    assert all(f.size[0] * f.size[1] <= 64 * 14 * 14 for f in shrunk.frames)
    full = decode_video(data, sample_fps=None, max_pixels=400 * 400)
    assert full.frames[0].size == (300, 220)
    prepared, stamps = prepare_video(video_uri(data), "part", processor)
    whole = [processor([frames]) for _, frames in full.clips(processor.temporal_pool)]
    assert len(prepared.pixel_values) == len(whole) == len(stamps) == 2
    for got, want in zip(prepared.pixel_values, whole):
        torch.testing.assert_close(got, want.pixel_values, rtol=0, atol=0)


def test_a_video_over_the_model_length_is_refused_before_its_frames_are_kept(monkeypatch):
    from k3.media import video
    from k3.media.image_processor import ImageProcessor
    from k3.serve.api.images import ImageError
    from k3.serve.api.videos import prepare_video

    processor = ImageProcessor(max_patches_per_frame=64, max_pixels=400 * 400, sample_fps=None)
    monkeypatch.setattr(video._Decoding, "keep", lambda self, frame: pytest.fail("a frame was kept"))
    with pytest.raises(ImageError, match=r"part: its 6 sampled frames need 30 image tokens, more than the 29 "):
        prepare_video(video_uri(gif_bytes(6, size=(300, 220))), "part", processor, max_placeholders=29)

